"""Idle runs are reaped by beat; leftovers of runs that no longer exist are reconciled away."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from poolcore.state import Store
from tests.conftest import Router, private_stack, wait_for
from tests.test_runs_api import finished, submit, tool_call


@pytest.fixture(scope="module")
def short_ttl_stack(base_image, docker_client):
    yield from private_stack(docker_client, {"WORKER_RUN_IDLE_TTL": "3"}, beat=True)


def test_idle_run_is_reaped(short_ttl_stack, docker_client):
    router = Router(short_ttl_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    assert router.run_containers(docker_client, lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 40), "idle run was not reaped"
    reply = short_ttl_stack.post("/heartbeat", {"lease_id": lease})
    assert reply.status_code == 500 and "Unknown run_lease_id" in reply.json()["error"]
    assert short_ttl_stack.get("/status").json()["pool"]["total_active_runs"] == 0


def test_heartbeat_keeps_a_run_alive(short_ttl_stack):
    """Heartbeats keep a lease alive through reaper rounds; a lease allocated after it, left
    without heartbeats, is reaped meanwhile: so the reaper did run while the first one was older
    than the idle limit, and only its heartbeats kept it."""
    stack = short_ttl_stack
    router, store = Router(stack), Store(stack.redis)
    kept = router.allocate("hello-file")
    control = router.allocate("hello-file")  # younger than `kept`: idle no longer than it

    def reaped(run_id: str) -> bool:
        return store.get_run(run_id)["state"] in ("closing", "closed")

    deadline = time.monotonic() + 90  # the reaper runs every 10 s; the idle limit is 3 s
    while not reaped(control) and time.monotonic() < deadline:
        assert stack.post("/heartbeat", {"lease_id": kept}).json() == {"ok": True}
        time.sleep(0.5)
    assert reaped(control), "the reaper never ran"
    assert store.get_run(control)["closing_reason"] == "idle"
    run = store.get_run(kept)
    assert run["state"] == "allocated", f"a run kept alive by heartbeats was reaped: {run}"
    assert time.time() - float(run["created_at"]) > 3  # well past the idle limit
    assert router.close(kept)["found"] is True


LONG = 16  # seconds of work: past the idle limit (3 s) and at least one reaper round (every 10 s)
HELLO = "Hello, world!"


def hold_the_tests(tool) -> None:
    """Make hello-file's tests take LONG seconds more: its test script runs python3 from PATH,
    and /usr/local/bin comes before /usr/bin (`tool` makes a tool call on the run)."""
    wrapper = f'#!/bin/sh\nsleep {LONG}\nexec /usr/bin/python3 "$@"\n'
    tool("shell_write_content_to_file", content=wrapper, file_path="/usr/local/bin/python3")
    tool("shell_exec", id="main", command="chmod +x /usr/local/bin/python3", block=True, timeout=30)
    tool("shell_exec", id="main", command=f"echo '{HELLO}' > /app/hello.txt", block=True, timeout=30)


def test_a_run_is_not_reaped_under_long_work_on_either_face(short_ttl_stack):
    """A blocking tool call with no limit, an evaluation, a command: each works LONG seconds on
    its run, well past the idle limit, and each run is still live after it (the reaper counted
    a run as used only when a call began, and closed it under the call: RUN_CLOSED)."""
    stack, router = short_ttl_stack, Router(short_ttl_stack)

    def pool_call() -> str:
        lease = router.allocate("hello-file")
        assert router.reset(lease, "hello-file").status_code == 200
        assert router.sh(lease, f"sleep {LONG}; echo done", timeout=None).strip() == "done"
        return lease

    def pool_evaluation() -> str:
        lease = router.allocate("hello-file")
        assert router.reset(lease, "hello-file").status_code == 200
        hold_the_tests(lambda name, **args: router.tool(lease, name, **args))
        reply = router.evaluate(lease)
        assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
        return lease

    def runs_api(work) -> str:
        started = submit(stack, "hello-file")
        run_id = started["run_id"]
        assert finished(stack, started["job_id"])["state"] == "succeeded"
        job = finished(stack, work(run_id))
        assert job["state"] == "succeeded", job
        return run_id

    def runs_call(run_id: str) -> str:
        return tool_call(stack, run_id, "shell_exec", id="main", command=f"sleep {LONG}; echo done", timeout=None)

    def runs_command(run_id: str) -> str:
        reply = stack.post(f"/v1/runs/{run_id}/commands", {"command": f"sleep {LONG}; echo done"})
        assert reply.status_code == 202, reply.text
        return reply.json()["job_id"]

    def runs_evaluation(run_id: str) -> str:
        hold_the_tests(lambda name, **args: finished(stack, tool_call(stack, run_id, name, **args)))
        reply = stack.post(f"/v1/runs/{run_id}/evaluation", {})
        assert reply.status_code == 202, reply.text
        return reply.json()["job_id"]

    work = {
        "pool tool call": pool_call,
        "pool evaluation": pool_evaluation,
        "runs tool call": lambda: runs_api(runs_call),
        "runs command": lambda: runs_api(runs_command),
        "runs evaluation": lambda: runs_api(runs_evaluation),
    }
    with ThreadPoolExecutor(len(work)) as threads:
        runs = {name: future.result() for name, future in [(n, threads.submit(f)) for n, f in work.items()]}
    store = Store(stack.redis)
    for name, run_id in runs.items():
        run = store.get_run(run_id)
        assert run["state"] in ("ready", "evaluated"), f"{name}: its run was closed under it: {run}"
    # Their idle clocks started when the work ended: they are reaped now, idle.
    assert wait_for(lambda: all(store.get_run(r)["state"] == "closed" for r in runs.values()), 40)
    assert {store.get_run(r)["closing_reason"] for r in runs.values()} == {"idle"}


def test_worker_start_reconciles_orphans(short_ttl_stack, docker_client, base_image):
    orphan = docker_client.containers.run(
        base_image,
        ["sleep", "infinity"],
        detach=True,
        labels={
            "termpool.managed": "1",
            "termpool.host": short_ttl_stack.host_id,
            "termpool.run": "run-deadbeefdeadbeef",
        },
    )
    short_ttl_stack.kill("teardown")
    short_ttl_stack.start_worker("teardown")

    def gone():
        try:
            docker_client.containers.get(orphan.id)
            return False
        except Exception:
            return True

    assert wait_for(gone, 30), "orphaned container survived the worker's reconcile"


@pytest.fixture(scope="module")
def short_allocated_ttl_stack(base_image, docker_client):
    yield from private_stack(docker_client, {"WORKER_ALLOCATED_TTL": "3"}, beat=True)


def test_lease_never_reset_is_released(short_allocated_ttl_stack, docker_client):
    stack = short_allocated_ttl_stack
    router = Router(stack)
    lease = router.allocate("hello-file")
    # Heartbeats keep it from being idle; the allocated TTL still releases it.
    deadline = time.monotonic() + 60
    while stack.post("/heartbeat", {"lease_id": lease}).status_code == 200 and time.monotonic() < deadline:
        time.sleep(1)
    run = Store(stack.redis).get_run(lease)
    assert run["state"] in ("closing", "closed") and run["closing_reason"] == "never_reset", run
    assert wait_for(lambda: stack.get("/status").json()["pool"]["total_active_runs"] == 0, 30)


def test_reset_lease_outlives_the_allocated_ttl(short_allocated_ttl_stack, docker_client):
    stack = short_allocated_ttl_stack
    router = Router(stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    time.sleep(15)  # several reaper rounds past the 3 s TTL
    assert stack.post("/heartbeat", {"lease_id": lease}).json() == {"ok": True}
    assert router.close(lease)["found"] is True
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60)
