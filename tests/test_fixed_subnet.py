"""A task that allows one live run per host (fixture compose-fixed-subnet, modelled on a real
one: a fixed subnet, a static address per service, the agent's names through the task's own DNS
server and extra_hosts) on the session stack's one host: a whole episode scores 1.0; two
allocations at once give one lease and a 429 that says why (never the second /reset's 500 from
compose), and nothing is left. Two hosts: tests/test_many_hosts.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from poolcore.state import Store
from tests.conftest import wait_for

TASK = "compose-fixed-subnet"
WHY = "allows one live run per host (fixed subnet 10.231.0.0/24 (network 'labnet')"


def torn_down(store: Store, host: str) -> bool:
    """No run of the task is closing on the host (a closing one still holds its subnet)."""
    return all((store.get_run(run) or {}).get("task_key") != TASK for run in store.closing_runs(host))


def test_a_whole_episode(router, docker_client):
    assert router.solved_episode(docker_client, TASK) == 1.0


def test_two_at_once_get_one_lease_and_a_429_that_says_why(stack, router, docker_client):
    store = Store(stack.redis)
    assert wait_for(lambda: torn_down(store, stack.host_id), 90), "the last episode's teardown did not end"
    with ThreadPoolExecutor(2) as both:
        replies = list(both.map(lambda _: stack.post("/allocate", {"task_key": TASK}), range(2)))
    assert sorted(r.status_code for r in replies) == [200, 429], [r.text for r in replies]
    refused = next(r for r in replies if r.status_code == 429).json()
    assert refused["code"] == "RUN_SLOTS_EXHAUSTED" and refused["retryable"] is True, refused
    assert WHY in refused["error"], refused
    lease = next(r for r in replies if r.status_code == 200).json()["lease_id"]
    try:
        # The runs API knows the task from the request: the same answer.
        reply = stack.post("/v1/runs", {"task_meta": {"task_name": TASK}, "evaluate": True, "close": True})
        assert reply.status_code == 429 and WHY in reply.json()["error"], reply.text
        assert store.host_status(stack.host_id)["tasks"][TASK] == {"active_runs": 1}
        reply = router.reset(lease, TASK)
        assert reply.status_code == 200, reply.text
        router.solve(lease, TASK)
        reply = router.evaluate(lease)
        assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    finally:
        router.close(lease)
    # Until its teardown has ended, the closed run still holds the subnet: a new run waits.
    reply = stack.post("/allocate", {"task_key": TASK})
    if reply.status_code == 429:
        assert "teardown" in reply.json()["error"], reply.text
    else:
        assert reply.status_code == 200, reply.text
        router.close(reply.json()["lease_id"])
    assert wait_for(lambda: torn_down(store, stack.host_id), 90), "teardowns did not end"
    assert not router.run_containers(docker_client, lease)
    assert not docker_client.networks.list(filters={"label": f"termpool.run={lease}"})
    assert TASK not in store.host_status(stack.host_id)["tasks"]
    assert router.solved_episode(docker_client, TASK) == 1.0  # the host is free again


def test_another_key_for_the_same_task_gets_a_429_at_reset(stack, router, docker_client):
    """Keys that name no task folder hide the task from placement until /reset: the second
    run's start finds the subnet held on this host and answers 429 with the reason, not 500."""
    store = Store(stack.redis)
    assert wait_for(lambda: torn_down(store, stack.host_id), 90), "the last episode's teardown did not end"
    first, second = router.allocate("fixed-key-a"), router.allocate("fixed-key-b")
    try:
        assert router.reset(first, TASK).status_code == 200
        reply = router.reset(second, TASK)
        assert reply.status_code == 429, reply.text
        assert reply.json()["code"] == "RUN_SLOTS_EXHAUSTED" and "another run of it" in reply.json()["error"]
        assert not router.run_containers(docker_client, second)
        assert not docker_client.networks.list(filters={"label": f"termpool.run={second}"})
    finally:
        router.close(second)
        router.close(first)
    assert wait_for(lambda: not router.run_containers(docker_client, first), 90)
