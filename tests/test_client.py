"""termpool.client against the real stack (tests/conftest.py `stack`, fixture tasks): runs as
context managers, one-shot episodes, typed errors, retries of retryable failures, asyncio,
leases of the pool API and raw replies; plus what needs no stack: the error classes cover every code, and the client installs and
imports without any of the server's packages."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from devstack import ROOT, free_port
from poolcore.state import Store
from termpool import client as tc
from termpool.client import (
    AsyncPool,
    ClientError,
    InfrastructureError,
    Pool,
    RunClosed,
    RunSlotsExhausted,
    ServiceUnreachable,
    TaskError,
    TermpoolError,
    UnknownJob,
    UnknownLease,
    UnknownRun,
    exec_call,
)
from termpool.codes import CODES
from tests.conftest import run_containers, wait_for

SERVER_MODULES = (
    "flask",
    "celery",
    "kombu",
    "docker",
    "redis",
    "requests",
    "yaml",
    "app",
    "tasks",
    "poolcore",
    "environments",
)
# What the wheel ships: the client, the Harbor backend and the two modules the server shares with them.
SHIPPED = ["__init__.py", "client", "codes.py", "harbor.py", "tar_rules.py"]


# ---- no stack ---------------------------------------------------------------------------------
@pytest.mark.unit
def test_every_code_has_its_class():
    bases = {"client": ClientError, "task": TaskError, "infrastructure": InfrastructureError}
    for code in CODES.values():
        cls = tc.error_class(code.name)
        assert cls.code == code.name, code.name
        assert issubclass(cls, bases[code.kind]), (code.name, cls.__mro__)
        error = cls("x")
        assert (error.code, error.retryable, error.kind) == (code.name, code.retryable, code.kind)


@pytest.mark.unit
def test_unreachable_service_is_retried_then_raised():
    started = time.monotonic()
    with (
        Pool(f"http://127.0.0.1:{free_port()}", retries=3, backoff=0.05) as pool,
        pytest.raises(ServiceUnreachable) as caught,
    ):
        pool.status()
    assert caught.value.retryable and caught.value.status is None
    assert time.monotonic() - started >= 0.05 * (1 + 2 + 4) * 0.5  # three backoffs, jitter at most halves them


@pytest.mark.unit
def test_raw_request_to_an_unreachable_service_raises_httpx_error():
    with Pool(f"http://127.0.0.1:{free_port()}", retries=3) as pool, pytest.raises(httpx.ConnectError):
        pool.request("GET", "/healthz")  # sent once, as is: no retries, no typed error


@pytest.mark.unit
def test_client_module_imports_nothing_of_the_server():
    probe = f"import sys, termpool.client; print(sorted(m for m in {SERVER_MODULES!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pip_install_into_a_fresh_venv(tmp_path):
    """`pip install .` into a venv without system site-packages: the client, httpx and no more."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "requirements.txt"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "docs", src / "docs")
    shutil.copytree(ROOT / "termpool", src / "termpool", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    probe = (
        "import sys, termpool.client as c; from termpool.client import Pool, AsyncPool, UnknownRun; "
        f"print(c.__file__); print(sorted(m for m in {SERVER_MODULES!r} if m in sys.modules))"
    )
    out = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    where, imported = out.stdout.split("\n")[:2]
    assert where.startswith(str(venv)) and imported == "[]"
    package = Path(where).parent.parent
    assert sorted(p.name for p in package.iterdir() if p.name != "__pycache__") == SHIPPED
    for server_package in ("flask", "celery", "docker", "redis", "poolcore", "app", "tasks"):
        found = subprocess.run([python, "-c", f"import {server_package}"], cwd=tmp_path, capture_output=True)
        assert found.returncode != 0, f"{server_package} is installed with the client"


# ---- against the stack ----------------------------------------------------------------------
@pytest.fixture
def pool(stack):
    with Pool(stack.url, backoff=0.5) as p:
        yield p


@pytest.fixture
def containers_of(stack, docker_client):
    """A run's containers, a warm spare's included (tests/conftest.py run_containers)."""
    return lambda run_id: run_containers(docker_client, Store(stack.redis), run_id)


def test_run_as_context_manager_solves_and_leaves_nothing(pool, containers_of):
    with pool.start("hello-file", instruction="write the file") as run:
        assert "hello-file" in run.user_msg and len(run.tool_schemas) == 4
        assert containers_of(run.id)
        assert run.exec("echo hi").strip() == "hi"
        assert run.write_file("/app/hello.txt", "Hello, world!\n").startswith("Content successfully written")
        result = run.evaluate()
        assert result.score == 1.0 and set(result.tests.values()) == {"passed"}
        assert run.info()["state"] == "evaluated"
    assert wait_for(lambda: not containers_of(run.id), 120), "the run was not torn down"
    assert pool.run(run.id).info()["state"] in ("closing", "closed")


def test_interactive_session_and_close_on_error(pool, containers_of):
    with pytest.raises(RuntimeError, match="agent crashed"), pool.start("interactive-guess") as run:
        started = run.exec("guess", id="g", block=False)
        assert started.startswith("Session 'g' started.")
        seen = []
        assert wait_for(lambda: seen.append(run.view("g")) or "Enter the secret word" in "".join(seen), 30)
        assert "Wrong" in run.write_to_process("g", "banana")
        assert "Correct!" in run.write_to_process("g", "pineapple")
        assert run.evaluate().score == 1.0
        raise RuntimeError("agent crashed")  # the run is closed all the same
    assert wait_for(lambda: not containers_of(run.id), 120)


def test_submit_and_wait_a_job(pool):
    with pool.start("hello-file", wait=False) as run:
        assert run.user_msg is None and run.wait_ready() is run and "hello-file" in run.user_msg
        job = run.submit("shell_exec", id="a", command="sleep 1; echo done", block=True, timeout=30)
        assert job.wait().strip() == "done"
        assert pool.job(job.id).record()["state"] == "succeeded"
        assert run.tool("no_such_tool") == "[TOOL_ERROR] unknown tool: no_such_tool"
        run.close(wait=True)
        with pytest.raises(RunClosed) as caught:
            run.exec("echo late")
    assert caught.value.status == 409 and not caught.value.retryable


def test_typed_errors_for_unknown_ids(pool):
    with pytest.raises(UnknownRun) as caught:
        pool.run("run-0000000000000000")
    assert (caught.value.code, caught.value.status, caught.value.retryable) == ("UNKNOWN_RUN", 404, False)
    assert isinstance(caught.value, ClientError)
    with pytest.raises(UnknownJob):
        pool.job(str(uuid.uuid4())).wait()


def test_failed_start_raises_its_typed_error_and_frees_the_slot(pool, docker_client):
    key = f"broken-{uuid.uuid4().hex[:6]}"
    with pytest.raises(TermpoolError) as caught:
        pool.start("broken-dockerfile", task_key=key)
    error = caught.value
    # The class is the one of the failed job's code: TaskBuildFailed (a TaskError, not
    # retryable) where the worker reports the build failure by its code.
    assert type(error) is tc.error_class(error.job["code"]) and error.code == error.job["code"]
    assert error.retryable is error.job["retryable"] and "exit 3" in error.message
    assert error.job["kind"] == "start" and error.job["state"] == "failed"
    assert wait_for(lambda: key not in pool.status()["tasks"], 60), "the failed run still holds its slot"


def test_one_shot_episode(pool):
    episode = pool.episode("partial-pass", [exec_call("echo alpha > /app/alpha.txt && echo beta > /app/beta.txt")])
    assert episode.failure is None and episode.score == 0.75 and episode.state == "closed"
    assert episode.tests["test_never_passes"] == "failed" and len(episode.jobs) == 4
    assert episode.observations == ["Command executed successfully (no output)."]

    with pytest.raises(TermpoolError) as caught:
        pool.episode("broken-dockerfile", [exec_call("true")])
    episode = caught.value.episode
    assert caught.value.job["kind"] == "start" and episode.score is None and episode.state == "closed"
    assert episode.failure is caught.value and episode.observations == [None]
    assert pool.episode("broken-dockerfile", [exec_call("true")], check=False).failure.code == caught.value.code


def test_pool_api_lease_episode(pool, containers_of):
    request_id = uuid.uuid4().hex
    with pool.allocate("hello-file", request_id=request_id) as lease:
        assert lease.id.startswith("run-") and not lease.reused
        again = pool.allocate("hello-file", request_id=request_id)  # the same request: the same lease
        assert (again.id, again.reused) == (lease.id, True)
        assert lease.reset("hello-file", instruction="write the file") is lease
        assert "write the file" in lease.user_msg and len(lease.tool_schemas) == 4
        assert containers_of(lease.id)
        assert lease.exec("echo hi").strip() == "hi"
        assert lease.write_file("/app/hello.txt", "Hello, world!\n").startswith("Content successfully written")
        assert lease.tool("no_such_tool") == "[TOOL_ERROR] unknown tool: no_such_tool"
        lease.heartbeat()
        assert lease.evaluate().score == 1.0
        assert pool.run(lease.id).info()["state"] == "evaluated"  # a lease is a run of the runs API
    assert lease.close() is False  # closed on leaving the block: a second close finds nothing
    assert wait_for(lambda: not containers_of(lease.id), 120), "the lease was not torn down"


def test_pool_api_failures_raise_typed_errors(pool, containers_of):
    with pytest.raises(UnknownLease) as caught:
        pool.lease("run-0000000000000000").heartbeat()
    assert (caught.value.status, caught.value.retryable) == (500, False)
    assert caught.value.reply["error"] == "Unknown run_lease_id: run-0000000000000000"

    with pool.allocate(f"broken-{uuid.uuid4().hex[:6]}") as lease, pytest.raises(TermpoolError) as caught:
        lease.reset("broken-dockerfile")
    error = caught.value
    assert error.status == 500 and type(error) is tc.error_class(error.reply["code"]), repr(error)
    assert isinstance(error, tc.TaskError) and error.job is None
    assert not containers_of(lease.id)


def test_raw_request_gives_the_reply_whatever_its_status(pool):
    reply = pool.request("POST", "/allocate", json={})
    assert reply.status_code == 400 and reply.json()["code"] == "BAD_REQUEST"
    reply = pool.request("GET", "/v1/jobs/nope", params={"wait": "x"})
    assert reply.status_code in (400, 404) and reply.json()["ok"] is False
    assert pool.request("GET", "/healthz").json() == {"ok": True}


def test_capacity_exhausted_then_retried_until_a_slot_frees(stack, pool, router):
    """WORKER_MAX_RUNS_PER_TASK (8) leases of one task key, taken through /allocate."""
    key = f"cap-{uuid.uuid4().hex[:6]}"
    leases = [router.allocate(key) for _ in range(8)]
    try:
        with Pool(stack.url, retries=0) as impatient, pytest.raises(RunSlotsExhausted) as caught:
            impatient.start("hello-file", task_key=key)
        assert (caught.value.status, caught.value.retryable) == (429, True)

        release = threading.Timer(3.0, lambda: router.close(leases.pop()))
        release.start()
        started = time.monotonic()
        with (
            Pool(stack.url, retries=10, backoff=0.5, max_backoff=2.0) as patient,
            patient.start("hello-file", task_key=key) as run,  # 429s, backoff, then a slot
        ):
            assert run.exec("echo in").strip() == "in"
        assert time.monotonic() - started >= 3.0
        release.join()
    finally:
        for lease in leases:
            router.close(lease)


def test_asyncio_runs_many_episodes_from_one_loop(stack, containers_of):
    async def episode(pool: AsyncPool, i: int) -> tuple[str, float]:
        async with await pool.start("hello-file") as run:
            assert (await run.exec(f"echo {i}")).strip() == str(i)
            await run.write_file("/app/hello.txt", "Hello, world!\n")
            return run.id, (await run.evaluate()).score

    async def lease_episode(pool: AsyncPool) -> tuple[str, float]:
        async with await pool.allocate("hello-file") as lease:
            await lease.reset("hello-file")
            assert (await lease.exec("echo lease")).strip() == "lease"
            await lease.write_file("/app/hello.txt", "Hello, world!\n")
            return lease.id, (await lease.evaluate()).score

    async def main():
        async with AsyncPool(stack.url) as pool:
            scores = await asyncio.gather(*(episode(pool, i) for i in range(4)), lease_episode(pool))
            with pytest.raises(UnknownRun):
                await pool.run("run-0000000000000000")
            one_shot = await pool.episode("hello-file", [tc.write_file_call("/app/hello.txt", "Hello, world!\n")])
            return scores, one_shot

    results, one_shot = asyncio.run(main())
    assert [score for _, score in results] == [1.0] * 5 and one_shot.score == 1.0
    for run_id, _ in results:
        assert wait_for(lambda: not containers_of(run_id), 120)  # noqa: B023 (called in this iteration)


@pytest.mark.unit
def test_error_hierarchy_is_catchable_by_kind():
    assert issubclass(RunSlotsExhausted, tc.CapacityExhausted) and issubclass(tc.CapacityExhausted, ClientError)
    assert issubclass(tc.WorkerLost, InfrastructureError) and issubclass(tc.WaitTimeout, TimeoutError)
    assert issubclass(TermpoolError, Exception)
