"""A mass close sends one close job per run (tasks/close_recovery.py): with the teardown queue
long, the reaper's rounds (every 10 s) see runs closing past twice CLOSE_SESSION_TIMEOUT whose
close waits in the queue, and send them none; a close whose message was lost is still sent
again. Against a private real stack: Redis, dockerd, the Celery workers, beat, the facade."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from poolcore.dispatch import new_job_id
from poolcore.state import Store
from tasks.close_recovery import in_hand
from tests.conftest import private_stack, run_containers, wait_for
from tests.test_runs_api import finished, submit

RUNS = 24
REAP_SECONDS = 10  # beat's reaper period (tasks/celery_app.py)


@pytest.fixture(scope="module")
def slow_teardown(base_image, docker_client):
    """One teardown at a time, and a close stale (to the reaper) 2 s after its release."""
    env = {
        "TEARDOWN_CONCURRENCY": "1",
        "CLOSE_SESSION_TIMEOUT": "1",
        "WARM_POOL_SIZE": "0",
        "WORKER_MAX_RUNS_PER_TASK": str(RUNS + 4),
    }
    yield from private_stack(docker_client, env, beat=True)


def start_runs(stack, n: int) -> list[str]:
    def one(_):
        started = submit(stack, "hello-file")
        assert finished(stack, started["job_id"])["state"] == "succeeded"
        return started["run_id"]

    with ThreadPoolExecutor(8) as threads:
        return list(threads.map(one, range(n)))


def close_kinds(store: Store, run_id: str) -> list[str]:
    """The states of the run's close jobs."""
    return [job["state"] for job in store.get_jobs(store.run_jobs(run_id)) if job.get("kind") == "close"]


def test_a_mass_close_sends_one_close_job_per_run(slow_teardown, docker_client):
    stack, store = slow_teardown, Store(slow_teardown.redis)
    runs = start_runs(stack, RUNS)

    def close(run_id: str) -> None:
        reply = requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=60)
        assert reply.status_code == 202, reply.text

    began = time.monotonic()
    with ThreadPoolExecutor(8) as threads:
        list(threads.map(close, runs))
    # Closed again every way a client (or its retry) can: none sends a second close job.
    for run_id in runs[:4]:
        assert requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=60).status_code == 200
        assert stack.post("/close", {"lease_id": run_id}).json()["found"] is False
    assert wait_for(lambda: not store.closing_runs(stack.host_id), 300, 0.5), "the closes did not end"
    took = time.monotonic() - began
    # Runs stayed closing past the stale limit (2 s) through reaper rounds: the test tests something.
    assert took > 1.5 * REAP_SECONDS, f"the teardown queue drained in {took:.0f} s: too short to test"
    counts = {run_id: close_kinds(store, run_id) for run_id in runs}
    assert all(states == ["succeeded"] for states in counts.values()), counts
    assert all(not run_containers(docker_client, store, run_id) for run_id in runs)


def test_a_lost_close_is_sent_again(slow_teardown, docker_client):
    """A run released whose close job was recorded but never sent (its message lost), and one
    released with no close job at all: both are torn down by the reaper."""
    stack, store = slow_teardown, Store(slow_teardown.redis)
    lost_message, no_job = start_runs(stack, 2)
    assert store.release(lost_message) and store.release(no_job)
    lost_job = new_job_id()
    store.create_job(lost_job, lost_message, "close")  # queued, and never will it be taken
    closed = wait_for(lambda: all(store.get_run(r)["state"] == "closed" for r in (lost_message, no_job)), 90)
    assert closed, "a lost close was not sent again"
    assert close_kinds(store, no_job) == ["succeeded"]
    assert sorted(close_kinds(store, lost_message)) == ["failed", "succeeded"]  # the lost one ended with the run
    assert store.get_job(lost_job)["code"] == "RUN_CLOSED"
    assert not run_containers(docker_client, store, lost_message) and not run_containers(docker_client, store, no_job)


@pytest.mark.unit
def test_which_close_is_in_hand():
    now = time.time()
    old, new = {"state": "queued", "queued_at": now - 100}, {"state": "queued", "queued_at": now}
    running = {"state": "running", "queued_at": now - 100}
    assert not in_hand([], queue_waiting=True, queued_since=now - 10)  # no close at all
    assert in_hand([running], queue_waiting=False, queued_since=now - 10)
    assert in_hand([old], queue_waiting=True, queued_since=now - 10)  # its message may wait in the queue
    assert not in_hand([old], queue_waiting=False, queued_since=now - 10)  # the queue is empty: lost
    assert in_hand([new], queue_waiting=False, queued_since=now - 10)  # may be on its way
