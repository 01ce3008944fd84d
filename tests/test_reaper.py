"""Idle runs are reaped by beat; leftovers of runs that no longer exist are reconciled away."""
from __future__ import annotations

import pytest

from tests.conftest import Router, leftovers, wait_for
from tests.stack import Stack


@pytest.fixture(scope="module")
def short_ttl_stack(base_image, docker_client):
    s = Stack(env={"WORKER_RUN_IDLE_TTL": "3"}, beat=True).start()
    yield s
    s.stop()
    left = leftovers(docker_client, s.host_id)
    for name in left:
        docker_client.containers.get(name).remove(force=True)
    assert not left


def test_idle_run_is_reaped(short_ttl_stack, docker_client):
    router = Router(short_ttl_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    assert router.run_containers(docker_client, lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 40), "idle run was not reaped"
    reply = short_ttl_stack.post("/heartbeat", {"lease_id": lease})
    assert reply.status_code == 500 and "Unknown run_lease_id" in reply.json()["error"]
    assert short_ttl_stack.get("/status").json()["pool"]["total_active_runs"] == 0


def test_heartbeat_keeps_a_run_alive(short_ttl_stack, docker_client):
    import time

    router = Router(short_ttl_stack)
    lease = router.allocate("hello-file")
    for _ in range(8):
        assert short_ttl_stack.post("/heartbeat", {"lease_id": lease}).json() == {"ok": True}
        time.sleep(1)
    assert router.close(lease)["found"] is True


def test_worker_start_reconciles_orphans(short_ttl_stack, docker_client, base_image):
    orphan = docker_client.containers.run(
        base_image, ["sleep", "infinity"], detach=True,
        labels={"termpool.managed": "1", "termpool.host": short_ttl_stack.host_id, "termpool.run": "run-deadbeefdeadbeef"})
    short_ttl_stack.kill("teardown")
    short_ttl_stack.start_worker("teardown")

    def gone():
        try:
            docker_client.containers.get(orphan.id)
            return False
        except Exception:
            return True

    assert wait_for(gone, 30), "orphaned container survived the worker's reconcile"
