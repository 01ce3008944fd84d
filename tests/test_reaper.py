"""Idle runs are reaped by beat; leftovers of runs that no longer exist are reconciled away."""

from __future__ import annotations

import time

import pytest

from termpool.state import Store
from tests.conftest import Router, private_stack, wait_for


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
