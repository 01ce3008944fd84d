"""No run reaches another run's containers, on any path (the one-service fast path, a warm
spare, a fork, compose), while each reaches its own sidecars but no port of the host;
tried from inside the containers, as an agent would scan (environments/networks.py)."""

from __future__ import annotations

import socket

import pytest

from environments import networks
from poolcore.state import Store
from tests.conftest import Router, private_stack, run_containers, wait_for

ONE_SERVICE = "hello-file"
COMPOSE = "compose-counter"  # its sidecar `counter` listens on 8000
PORT = 8099  # the listener each one-service run starts


@pytest.fixture(scope="module")
def stack(base_image, docker_client):
    yield from private_stack(docker_client, {"WARM_POOL_SIZE": "2", "WARM_DEMAND_WINDOW": "600"})


@pytest.fixture(scope="module")
def router(stack) -> Router:
    return Router(stack)


def started(router: Router, task: str) -> str:
    lease = router.allocate(task)
    reply = router.reset(lease, task)
    assert reply.status_code == 200, reply.text
    return lease


def listen(router: Router, lease: str) -> None:
    router.sh(lease, f"(nohup python3 -m http.server {PORT} >/dev/null 2>&1 &) ; sleep 1")


def reach(router: Router, lease: str, address: str, port: int) -> str:
    """'open', or why the connection from the run's agent container failed."""
    probe = (
        "import socket,sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), 3).close(); print('open')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    router.tool(lease, "shell_write_content_to_file", content=probe, file_path="/tmp/probe.py")
    return router.sh(lease, "python3 /tmp/probe.py").strip().splitlines()[-1]


def addresses(router: Router, docker_client, lease: str) -> dict[str, str]:
    """Each container of the run (by compose service, '' for a one-service run): its address."""
    out = {}
    for container in run_containers(docker_client, Store(router.stack.redis), lease):
        nets = container.attrs["NetworkSettings"]["Networks"]
        service = container.labels.get("com.docker.compose.service", "")
        out[service] = next(n["IPAddress"] for n in nets.values() if n["IPAddress"])
    return out


def warm_served(router: Router) -> str:
    """A run a warm spare served (resets until the pool has filled after the first demand)."""

    def one():
        lease = started(router, ONE_SERVICE)
        if (Store(router.stack.redis).get_run(lease).get("env") or {}).get("warm_id"):
            return lease
        router.close(lease)
        return None

    lease = wait_for(one, 120, 2)
    assert lease, "no reset was served by a warm spare"
    return lease


def test_no_run_reaches_another_on_any_path(stack, router, docker_client):
    cold_a, cold_b = started(router, ONE_SERVICE), started(router, ONE_SERVICE)
    warm = warm_served(router)
    compose_a, compose_b = started(router, COMPOSE), started(router, COMPOSE)
    [fork] = router.pool.lease(cold_a).fork(1)
    one_service = {"cold a": cold_a, "cold b": cold_b, "warm": warm, "fork": fork.id}
    for lease in one_service.values():
        listen(router, lease)
    targets = {name: (addresses(router, docker_client, lease)[""], PORT) for name, lease in one_service.items()}
    for name, lease in {"compose a": compose_a, "compose b": compose_b}.items():
        targets[f"{name} sidecar"] = (addresses(router, docker_client, lease)["counter"], 8000)
    sources = {**one_service, "compose a": compose_a, "compose b": compose_b}
    try:
        for source, lease in sources.items():
            for target, (address, port) in targets.items():
                if target == source or target == f"{source} sidecar":
                    continue
                assert reach(router, lease, address, port) == "ConnectionRefusedError", (source, target, address)
        # Its own sidecar, by name and by address; its own listener.
        assert reach(router, compose_a, "counter", 8000) == "open"
        assert reach(router, compose_b, *targets["compose b sidecar"]) == "open"
        assert reach(router, cold_a, "127.0.0.1", PORT) == "open"
    finally:
        for lease in sources.values():
            router.close(lease)


def test_a_one_service_run_reaches_no_port_of_the_host(stack, router, docker_client):
    """Its bridge's gateway is the host: containment refuses every port there, not only the
    pool's (tests/test_containment.py covers CONTAINMENT_HOST_ALLOW and every host address)."""
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        lease = started(router, ONE_SERVICE)
        try:
            [container] = run_containers(docker_client, Store(stack.redis), lease)
            [network] = container.attrs["NetworkSettings"]["Networks"].values()
            assert reach(router, lease, network["Gateway"], server.getsockname()[1]) == "ConnectionRefusedError"
            assert reach(router, lease, network["Gateway"], stack.port) == "ConnectionRefusedError"  # the API
        finally:
            router.close(lease)


def test_a_full_bridge_sends_the_next_container_to_another_shard(base_image, docker_client):
    """Shards below a Linux bridge's port limit (ISOLATED_BRIDGE_SIZE, here 1 container each):
    a shard with room is chosen, and the shards keep their containers apart too."""
    made = []
    try:
        for _ in range(2):
            network = networks.isolated_network(1)
            made.append(docker_client.containers.run(base_image, ["sleep", "60"], network=network, detach=True))
        first, second = ({*c.attrs["NetworkSettings"]["Networks"]} for c in (made[0], made[1]))
        assert first != second, "a full shard took another container"
        [address] = [
            n["IPAddress"]
            for n in docker_client.containers.get(made[0].id).attrs["NetworkSettings"]["Networks"].values()
        ]
        probe = f"import socket; socket.create_connection(({address!r}, 9), 2)"
        code, output = made[1].exec_run(["python3", "-c", probe])
        assert code != 0 and b"Error" in output, output
    finally:
        for container in made:
            container.remove(force=True)
        for network in docker_client.networks.list(filters={"label": networks.ISOLATED_LABEL}):
            network.reload()
            if network.name != networks.ISOLATED_NAME.format(shard=0) and not network.attrs.get("Containers"):
                network.remove()  # the extra shards this test made (an empty one costs Docker a pool)
