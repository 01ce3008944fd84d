"""Harbor tasks on a pool of two worker hosts (the stack's on the machine's dockerd, a second
host's on a second dockerd, tests/second_docker.py): a whole episode of a compose task with a
sidecar on each host, its images built and its containers run on that host's daemon only."""

from __future__ import annotations

import pytest

from poolcore.state import Store
from tests.conftest import run_containers
from tests.second_docker import second_docker, two_host_stack  # noqa: F401 (the fixture)
from tests.test_harbor_tasks import STACK_ENV, harbor_close, harbor_reset, harbor_sh, harbor_solve
from tests.test_many_hosts import hosts_cli

TASK = "harbor-compose-sidecar"


@pytest.fixture(scope="module")
def two_hosts(second_docker, docker_client):  # noqa: F811 (the fixture imported above)
    yield from two_host_stack(second_docker, docker_client, STACK_ENV)


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_harbor_episode_on_each_host(two_hosts, side):
    host = two_hosts.host_id if side == "a" else two_hosts.host_b
    other = two_hosts.host_b if side == "a" else two_hosts.host_id
    hosts_cli(two_hosts, "drain", other)  # placement then has one host to choose
    try:
        lease, _ = harbor_reset(two_hosts, TASK)
    finally:
        hosts_cli(two_hosts, "undrain", other)
    store = Store(two_hosts.redis)
    assert store.get_run(lease)["host"] == host
    for daemon_host, client in two_hosts.daemons.items():
        services = {c.labels.get("com.docker.compose.service") for c in run_containers(client, store, lease)}
        assert services == ({"main", "kv"} if daemon_host == host else set()), (daemon_host, services)
    assert harbor_sh(two_hosts, lease, "hostname >/dev/null && echo ok").strip() == "ok"
    harbor_solve(two_hosts, lease, TASK)
    reply = two_hosts.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    harbor_close(two_hosts, two_hosts.daemons[host], lease)
