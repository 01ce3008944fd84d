"""The failure detector on a real stack (poolcore/liveness.py): a hung worker, a Redis that
stops answering, and a host whose workers all die, each with the outcome the docs promise."""

from __future__ import annotations

import os
import signal
import time

import pytest

from devstack import WORKER_KINDS, Stack
from poolcore.config import load_settings
from poolcore.state import Store
from termpool.client import HostLost, WorkersDown
from tests.conftest import Router, stop_checking_leaks, wait_for

TASK = "hello-file"
HUNG_SECONDS = 30.0


@pytest.fixture(scope="module")
def stack(base_image, docker_client):
    s = Stack().start()
    yield s
    stop_checking_leaks(s, docker_client)


@pytest.fixture(scope="module")
def router(stack) -> Router:
    return Router(stack)


@pytest.fixture
def lease(router):
    lease = router.allocate(TASK)
    assert router.reset(lease, TASK).status_code == 200
    yield lease
    router.close(lease)


def silence(stack: Stack) -> float:
    return load_settings(stack.env).host_silence


def test_a_hung_worker_fails_its_kinds_calls_and_the_host_serves_on(stack, router, lease):
    """SIGSTOP of the exec worker for 30 s (hung, not dead): a tool call fails WORKERS_DOWN
    (retryable) once exec has been silent past the limit, and is never run afterwards; the
    host's other kinds keep serving (a new run starts, an evaluation runs); after SIGCONT exec
    serves again at its next beat."""
    exec_group = stack.procs["exec"].pid
    os.killpg(exec_group, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with pytest.raises(WorkersDown):
            router.sh(lease, "touch /tmp/ran-while-hung")
        assert time.monotonic() - stopped < silence(stack) + 8
        other = router.allocate(TASK)
        try:
            assert router.reset(other, TASK).status_code == 200
            assert router.evaluate(lease).status_code == 200
            started = time.monotonic()
            with pytest.raises(WorkersDown):  # while exec stays silent, at once
                router.sh(other, "echo no")
            assert time.monotonic() - started < 3
        finally:
            router.close(other)
        time.sleep(max(0.0, HUNG_SECONDS - (time.monotonic() - stopped)))
    finally:
        os.killpg(exec_group, signal.SIGCONT)
    assert wait_for(lambda: _answers(router, lease), 30), "exec did not serve again after SIGCONT"
    assert router.sh(lease, "test -e /tmp/ran-while-hung && echo ran || echo never") == "never\n"
    failed = [j for j in _jobs(stack, lease) if j.get("code") == "WORKERS_DOWN"]
    assert failed and all(j["state"] == "failed" for j in failed), failed


def test_a_redis_that_stops_answering_is_nobodys_death(stack, router, lease):
    """Redis hangs (SIGSTOP: packets unanswered, as in a partition) for longer than the limit.
    Once it answers again, nothing is judged silent for the time it could not be reached."""
    redis_pid = stack.procs["redis"].pid
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        time.sleep(silence(stack) + 3)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    assert router.sh(lease, "echo after") == "after\n"
    other = router.allocate(TASK)
    try:
        assert router.reset(other, TASK).status_code == 200
        assert router.evaluate(other).status_code == 200
    finally:
        router.close(other)
    assert stack.client.status()["hosts"][stack.host_id]["state"] == "serving"


def test_a_host_whose_workers_all_die_is_lost_within_20_s(stack, router):
    lease = router.allocate(TASK)
    assert router.reset(lease, TASK).status_code == 200
    for kind in WORKER_KINDS:  # all at once, as a machine dies
        os.killpg(stack.procs[kind].pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        with pytest.raises(HostLost):
            router.sh(lease, "echo lost")
        assert time.monotonic() - killed < 20
    finally:
        for kind in WORKER_KINDS:
            stack.procs.pop(kind).wait(timeout=60)
            stack.start_worker(kind, wait=False)
        for kind in WORKER_KINDS:
            stack.wait_worker(kind)
        stack.wait_serving(stack.host_id)
        router.close(lease)


def _answers(router: Router, lease: str) -> bool:
    try:
        return router.sh(lease, "echo back") == "back\n"
    except WorkersDown:
        return False


def _jobs(stack: Stack, run_id: str) -> list[dict]:
    store = Store.from_url(stack.env["REDIS_URL"])
    return [store.get_job(job_id) or {} for job_id in store.run_jobs(run_id)]
