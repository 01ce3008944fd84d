"""The warm pool (on by default): started spares per one-service task, sized from recent resets,
each handed to exactly one run, shrunk when demand stops, none kept past WARM_IDLE_TTL, and
removed when the host stops cleanly (the module's stack must end with no container left)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import docker.errors
import pytest

from poolcore.state import Store, warm_key
from tests.conftest import Router, private_stack, wait_for

TASK = "hello-file"
WINDOW = 45  # WARM_DEMAND_WINDOW of the module's stack
IDLE_TTL = 10  # WARM_IDLE_TTL of the module's stack: shorter, so spares expire while wanted
PASS = 10  # beat's pool.size_warm period (tasks/warm_pool.py SIZE_SECONDS)


@pytest.fixture(scope="module")
def warm_stack(base_image, docker_client):
    env = {"WARM_DEMAND_WINDOW": str(WINDOW), "WARM_IDLE_TTL": str(IDLE_TTL)}
    yield from private_stack(docker_client, env, beat=True)


def pooled(stack) -> list[dict]:
    return [json.loads(e) for e in stack.redis.lrange(warm_key(stack.host_id, TASK), 0, -1)]


def warm_containers(docker_client, stack) -> list:
    found = docker_client.containers.list(
        all=True, filters={"label": f"termpool.host={stack.host_id}"}, ignore_removed=True
    )  # polled while the pool trims spares: one may go between the listing and its inspect
    return [c for c in found if c.labels.get("termpool.run", "").startswith("warm-")]


def client_of(stack, lease) -> str:
    return Store(stack.redis).get_run(lease)["env"]["client"]


def exists(docker_client, name) -> bool:
    try:
        docker_client.containers.get(name)
        return True
    except docker.errors.NotFound:
        return False


def test_a_spare_serves_one_run_and_runs_on_it_work(warm_stack, docker_client):
    router = Router(warm_stack)
    first = router.allocate(TASK)
    assert router.reset(first, TASK).status_code == 200  # cold (the image may be built)
    assert wait_for(lambda: len(pooled(warm_stack)) == 1, 90), "one reset did not leave a spare"
    spare = pooled(warm_stack)[0]["client"]

    lease = router.allocate(TASK)
    assert router.reset(lease, TASK).status_code == 200
    assert client_of(warm_stack, lease) == spare, "the reset did not take the spare"
    assert spare not in [e["client"] for e in pooled(warm_stack)]
    router.solve(lease, TASK)
    assert router.evaluate(lease).json()["score"] == 1.0
    router.close(lease)
    # A claimed spare goes with its run: never back to the pool, never to a second run.
    assert wait_for(lambda: not exists(docker_client, spare), 60), "the run's container outlived its close"
    assert spare not in [e["client"] for e in pooled(warm_stack)]
    router.close(first)


def test_the_pool_grows_under_a_burst_and_each_spare_goes_to_one_run(warm_stack, docker_client):
    router = Router(warm_stack)
    assert wait_for(lambda: len(pooled(warm_stack)) >= 1, 60)
    leases = [router.allocate(TASK) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda lease: router.reset(lease, TASK), leases))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    clients = [client_of(warm_stack, lease) for lease in leases]
    assert len(set(clients)) == 4, "two runs got the same container"
    # Four resets at once: more than one spare is wanted now (the exact size depends on the
    # measured start time, see poolcore/warm_sizing.py).
    assert wait_for(lambda: len(pooled(warm_stack)) >= 2, 90), "the pool did not grow under demand"
    assert not set(clients) & {e["client"] for e in pooled(warm_stack)}
    for lease in leases:
        router.close(lease)


def test_no_spare_outlives_the_idle_ttl(warm_stack, docker_client):
    assert wait_for(lambda: pooled(warm_stack), 60), "no spare to watch"
    watched = {e["client"] for e in pooled(warm_stack)}
    # No reset claims them here: the periodic pass removes them; the demand of the previous
    # test is still within the window, so fresh spares take their place.
    assert wait_for(lambda: not any(exists(docker_client, c) for c in watched), IDLE_TTL + 3 * PASS + 30), (
        "a spare outlived WARM_IDLE_TTL"
    )
    assert wait_for(lambda: pooled(warm_stack), 60), "expired spares were not replaced while demand lasted"
    assert not watched & {e["client"] for e in pooled(warm_stack)}
    now = time.time()
    assert all(now - e["pushed_at"] <= IDLE_TTL + 2 * PASS for e in pooled(warm_stack))


def test_the_pool_empties_when_demand_stops(warm_stack, docker_client):
    # No reset since the previous test: once the window has passed, the pool is emptied and
    # the task is no longer looked after.
    def idle() -> bool:
        tasks = Store(warm_stack.redis).warm_tasks(warm_stack.host_id)
        return not pooled(warm_stack) and not warm_containers(docker_client, warm_stack) and not tasks

    assert wait_for(idle, WINDOW + 90), "spares were kept with no demand"


def test_reconcile_keeps_pooled_containers(warm_stack, docker_client, base_image):
    router = Router(warm_stack)
    lease = router.allocate(TASK)
    assert router.reset(lease, TASK).status_code == 200
    router.close(lease)
    assert wait_for(lambda: len(pooled(warm_stack)) >= 1, 60)
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
    assert wait_for(lambda: not exists(docker_client, orphan.id), 30), "the reconcile sweep did not run"
    assert all(exists(docker_client, c) for c in waiting)
    # The module's stack stops now with a spare pooled: its lifecycle worker removes it
    # (private_stack fails the module on any container left).
