"""The opt-in warm pool: pre-started containers per task, refilled in the background, each
handed to exactly one run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from termpool.state import Store, warm_key
from tests.conftest import Router, leftovers, wait_for
from tests.stack import Stack


@pytest.fixture(scope="module")
def warm_stack(base_image, docker_client):
    s = Stack(env={"WARM_POOL_SIZE": "2"}).start()
    yield s
    s.stop()
    # Pooled containers outlive the stack by design (they wait for the next run); clean up.
    for name in leftovers(docker_client, s.host_id):
        docker_client.containers.get(name).remove(force=True)


def pooled(stack) -> list[dict]:
    return [json.loads(e) for e in stack.redis.lrange(warm_key(stack.host_id, "hello-file"), 0, -1)]


def client_of(stack, lease) -> str:
    return Store(stack.redis).get_run(lease)["env"]["client"]


def test_pool_fills_after_first_reset_and_serves_next_runs(warm_stack, docker_client):
    router = Router(warm_stack)
    first = router.allocate("hello-file")
    assert router.reset(first, "hello-file").status_code == 200
    assert wait_for(lambda: len(pooled(warm_stack)) == 2, 60), "warm pool did not fill"
    waiting = {e["client"] for e in pooled(warm_stack)}

    leases = [router.allocate("hello-file") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda lease: router.reset(lease, "hello-file"), leases))
    assert all(r.status_code == 200 for r in replies)
    clients = [client_of(warm_stack, lease) for lease in leases]
    assert len(set(clients)) == 2 and set(clients) <= waiting, "each warm container goes to one run"

    # The runs work like cold ones: tools, evaluation with the solution, artifacts.
    router.solve(leases[0], "hello-file")
    assert router.evaluate(leases[0]).json()["score"] == 1.0
    assert router.evaluate(leases[1]).json()["score"] == 0.0

    assert wait_for(lambda: len(pooled(warm_stack)) == 2, 60), "warm pool was not refilled"
    for lease in [first, *leases]:
        router.close(lease)
    assert wait_for(lambda: all(not _exists(docker_client, c) for c in clients), 60)


def test_reconcile_keeps_pooled_containers(warm_stack, docker_client, base_image):
    assert wait_for(lambda: len(pooled(warm_stack)) == 2, 60)
    waiting = [e["client"] for e in pooled(warm_stack)]
    # An orphan beside them shows when the sweep has run.
    orphan = docker_client.containers.run(
        base_image,
        ["sleep", "infinity"],
        detach=True,
        labels={"termpool.managed": "1", "termpool.host": warm_stack.host_id, "termpool.run": "warm-0000000000000000"},
    )
    warm_stack.kill("teardown")
    warm_stack.start_worker("teardown")
    assert wait_for(lambda: not _exists(docker_client, orphan.id), 30), "the reconcile sweep did not run"
    assert all(_exists(docker_client, c) for c in waiting)


def _exists(docker_client, name) -> bool:
    try:
        docker_client.containers.get(name)
        return True
    except Exception:
        return False
