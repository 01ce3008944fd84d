"""Run networks from the host's own range (RUN_SUBNETS), through the real stack: each compose
run's network gets a block; a block something else on the machine uses is reserved at the
worker's start; a full range answers 429 before any container starts; /status counts the
blocks; teardown and the reconcile give them back."""

from __future__ import annotations

import ipaddress

import pytest

from poolcore.config import load_settings
from poolcore.queues import make_celery
from poolcore.state import Store
from tests.conftest import Router, private_stack, run_containers, wait_for

TASK = "compose-counter"  # one network (default) for its two services
RANGE = "10.191.0.0/26"  # 4 blocks of /28, apart from every stack's own range (devstack/stack.py)
FOREIGN = "10.191.0.48/28"  # block 3, taken by a network termpool did not make


@pytest.fixture(scope="module")
def foreign(docker_client):
    network = docker_client.networks.create(
        "termpool-test-foreign", driver="bridge", ipam={"Config": [{"Subnet": FOREIGN}]}
    )
    yield network
    network.remove()


@pytest.fixture(scope="module")
def stack(base_image, docker_client, foreign):
    yield from private_stack(docker_client, {"RUN_SUBNETS": RANGE, "RUN_SUBNET_PREFIX": "28", "WARM_POOL_SIZE": "0"})


@pytest.fixture(scope="module")
def router(stack) -> Router:
    return Router(stack)


def networks_status(stack) -> dict:
    return stack.get("/status").json()["pool"]["hosts"][stack.host_id]["networks"]


def subnet_of(router, docker_client, lease) -> str:
    containers = run_containers(docker_client, Store(router.stack.redis), lease)
    [network] = {name for c in containers for name in c.attrs["NetworkSettings"]["Networks"]}
    return docker_client.networks.get(network).attrs["IPAM"]["Config"][0]["Subnet"]


def test_a_full_range_answers_429_before_any_container_starts(stack, router, docker_client):
    assert wait_for(lambda: networks_status(stack)["reserved"] == 1, 30), networks_status(stack)
    assert networks_status(stack) == {"total": 4, "in_use": 0, "reserved": 1, "free": 3}
    leases = [router.allocate(TASK) for _ in range(4)]
    try:
        for lease in leases[:3]:
            reply = router.reset(lease, TASK)
            assert reply.status_code == 200, reply.text
        subnets = {subnet_of(router, docker_client, lease) for lease in leases[:3]}
        assert len(subnets) == 3 and FOREIGN not in subnets
        assert all(ipaddress.ip_network(s).subnet_of(ipaddress.ip_network(RANGE)) for s in subnets), subnets
        assert networks_status(stack) == {"total": 4, "in_use": 3, "reserved": 1, "free": 0}

        reply = router.reset(leases[3], TASK)
        assert reply.status_code == 429, reply.text
        assert reply.json()["code"] == "HOST_NETWORKS_EXHAUSTED" and reply.json()["retryable"] is True
        assert "RUN_SUBNETS" in reply.json()["error"]
        assert not run_containers(docker_client, Store(stack.redis), leases[3]), "it started something"

        router.close(leases[0])  # its teardown gives its block back
        assert wait_for(lambda: networks_status(stack)["free"] == 1, 60), networks_status(stack)
        reply = router.reset(leases[3], TASK)
        assert reply.status_code == 200, reply.text
        fetch = "python3 -c \"import urllib.request as u; print(u.urlopen('http://counter:8000').status)\""
        assert router.sh(leases[3], fetch).strip().endswith("200"), "its own sidecar is reached by name"
    finally:
        for lease in leases:
            router.close(lease)
    assert wait_for(lambda: networks_status(stack)["in_use"] == 0, 60), networks_status(stack)


def test_the_reconcile_gives_back_the_blocks_of_runs_that_are_gone(stack):
    """A teardown cut short between removing a run's networks and giving its blocks back."""
    store = Store(stack.redis)
    assert store.take_subnets(stack.host_id, "run-gone0000000000", 1, 4) is not None
    make_celery(load_settings(stack.env)).send_task("pool.reconcile", kwargs={"host": stack.host_id})
    assert wait_for(lambda: "run-gone0000000000" not in store.subnet_owners(stack.host_id), 30)
