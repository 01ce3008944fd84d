"""Task containers cannot reach their pool's API, Redis or Flower (environments/containment.py), yet
still reach their sidecars and the outside."""

from __future__ import annotations

import errno
import io
import ipaddress
import shutil
import socket
import subprocess
import uuid

import docker.errors
import pytest

from devstack import free_port
from environments import compose_config, containment
from environments.containment import Guard
from termpool.config import load_settings
from termpool.failures import TaskUnsupported
from tests.conftest import Router, private_stack, wait_for


# ---- pure logic -------------------------------------------------------------------------------
@pytest.mark.unit
def test_local_redis_is_a_port_and_remote_redis_an_address():
    local = containment.guard_from_settings(
        load_settings(
            {
                "REDIS_URL": "redis://127.0.0.1:6400/0",
                "ENV_SERVER_PORT": "18100",
                "FLOWER_PORT": "5600",
                "POOL_HOST_ID": "h 1",
            }
        )
    )
    assert local.local_ports == (5600, 6400, 18100) and local.remote == () and local.tag == "h_1"
    remote = containment.guard_from_settings(
        load_settings({"REDIS_URL": "redis://192.0.2.77:6390/0", "CONTAINMENT_BLOCK": "198.51.100.0/24, 192.0.2.9:80"})
    )
    assert ("192.0.2.77", 6390) in remote.remote and 6390 not in remote.local_ports
    assert ("198.51.100.0/24", None) in remote.remote and ("192.0.2.9", 80) in remote.remote


@pytest.mark.unit
def test_rules_reject_task_traffic_to_the_pool_and_exempt_its_own_bridge():
    guard = Guard("p", (18081, 6379), (("192.0.2.7", 6379), ("fd00::7", None)), ("docker0",), ("br-own",))
    v4 = [(chain, " ".join(rule)) for chain, rule in containment.rules(guard, "iptables")]
    tag = "-m comment --comment termpool:p"
    reject = "-j REJECT --reject-with tcp-reset"
    assert v4[0] == ("TERMPOOL-INPUT", f"-i br-own {tag} -j RETURN")
    assert v4[1] == ("TERMPOOL-FORWARD", f"-i br-own {tag} -j RETURN")
    assert ("TERMPOOL-INPUT", f"-i docker0 -p tcp -m multiport --dports 18081,6379 {tag} {reject}") in v4
    assert (
        "TERMPOOL-FORWARD",
        f"-i docker0 -p tcp -m conntrack --ctstate DNAT --ctorigdstport 6379 {tag} {reject}",
    ) in v4
    assert ("TERMPOOL-FORWARD", f"-i docker0 -d 192.0.2.7 -p tcp --dport 6379 {tag} {reject}") in v4
    assert ("TERMPOOL-FORWARD", f"-i docker0 -o br-own {tag} -j REJECT") in v4
    assert not any("fd00::7" in rule for _, rule in v4)
    v6 = [" ".join(rule) for _, rule in containment.rules(guard, "ip6tables")]
    assert f"-i docker0 -d fd00::7 {tag} -j REJECT" in v6


@pytest.mark.parametrize(
    "resolved",
    [
        {"services": {"client": {"network_mode": "host"}}},
        {"services": {"client": {"network_mode": "container:termpool-api-1"}}},
        {"services": {}, "networks": {"pool": {"name": "termpool_default", "external": True}}},
        {"services": {}, "networks": {"lan": {"driver": "macvlan"}}},
        {"services": {}, "networks": {"default": {"driver_opts": {"com.docker.network.bridge.name": "eth9"}}}},
    ],
)
@pytest.mark.unit
def test_task_networks_that_escape_the_filter_are_refused(resolved, tmp_path):
    with pytest.raises(TaskUnsupported):
        compose_config.check_supported(resolved, tmp_path)


@pytest.mark.unit
def test_ordinary_task_networks_pass(tmp_path):
    compose_config.check_supported(
        {
            "services": {"client": {}, "db": {"network_mode": "service:client"}, "x": {"network_mode": "none"}},
            "networks": {"default": {"name": "p_default"}, "back": {"driver": "bridge", "internal": True}},
        },
        tmp_path,
    )


# ---- from inside real task containers ---------------------------------------------------------


def _host_ipv4() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    addresses = [line.split()[3].split("/")[0] for line in out.splitlines()]
    return [a for a in addresses if not ipaddress.ip_address(a).is_loopback]


class Listeners:
    """Plain TCP listeners on the host, on given ports of each of its addresses."""

    def __init__(self):
        self.socks = []
        self.gone: set[str] = set()  # addresses that left the host meanwhile

    def open(self, port: int, addresses: list[str]) -> None:
        for address in addresses:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))  # beside a service bound to 127.0.0.1 or 0.0.0.0 only
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                self.gone.add(address)  # the bridge of another stack's run, removed since the listing
                continue
            sock.listen(16)
            self.socks.append(sock)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@pytest.fixture(scope="module")
def contained(base_image, docker_client):
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (root)")
    flower = free_port()  # nothing serves it: the test listens there itself
    for stack in private_stack(docker_client, {"CONTAINMENT": "require", "FLOWER_PORT": str(flower)}):
        stack.flower_port = flower
        yield stack  # Stack.stop() removes the rules


def _probe(router: Router, lease: str, targets: list[tuple[str, int]]) -> dict:
    """Connect from the task's client container to each host:port; {target: True if open}."""
    checks = " ".join(f"{host}:{port}" for host, port in targets)
    command = (
        f'for t in {checks}; do if timeout 5 bash -c "exec 3<>/dev/tcp/${{t%:*}}/${{t##*:}}" 2>/dev/null; '
        f'then echo "$t open"; else echo "$t closed"; fi; done'
    )
    out = router.sh(lease, command)
    result = {}
    for line in out.splitlines():
        target, state = line.rsplit(" ", 1)
        host, port = target.rsplit(":", 1)
        result[(host, int(port))] = state == "open"
    assert set(result) == set(targets), out
    return result


def _gateway(docker_client, router, lease) -> str:
    [client] = [
        c
        for c in router.run_containers(docker_client, lease)
        if c.labels.get("com.docker.compose.service", "client") == "client"
    ]
    networks = client.attrs["NetworkSettings"]["Networks"]
    return next(iter(networks.values()))["Gateway"]


@pytest.mark.parametrize("task", ["hello-file", "sidecar-kv"])  # docker0 (direct) and a br- network (compose)
def test_task_container_cannot_reach_the_pool(contained, docker_client, task):
    stack = contained
    router = Router(stack)
    lease = router.allocate(task)
    listeners = Listeners()
    try:
        assert router.reset(lease, task).status_code == 200
        gateway = _gateway(docker_client, router, lease)
        addresses = sorted(set(_host_ipv4()) | {gateway})
        other = free_port()  # not termpool's: must stay reachable (the probe works, rules are scoped)
        listeners.open(other, addresses)
        listeners.open(stack.redis_port, addresses)  # the stack's Redis listens on 127.0.0.1 only
        listeners.open(stack.flower_port, addresses)
        addresses = [a for a in addresses if a not in listeners.gone]
        targets = [(a, p) for a in addresses for p in (stack.port, stack.redis_port, stack.flower_port, other)]
        reach = _probe(router, lease, targets)
        assert not [t for t, ok in reach.items() if ok and t[1] != other], reach
        assert all(reach[(a, other)] for a in addresses), reach
        if task == "sidecar-kv":
            assert _probe(router, lease, [("kv", 8000)]) == {("kv", 8000): True}
        if _reachable("deb.debian.org", 80):
            assert _probe(router, lease, [("deb.debian.org", 80)]) == {("deb.debian.org", 80): True}
    finally:
        listeners.close()
        router.close(lease)
        assert wait_for(lambda: not router.run_containers(docker_client, lease), 60), "teardown did not finish"


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def image_with_iptables(base_image, docker_client):
    """Stands in for termpool's image, which installs iptables for this (Dockerfile)."""
    tag = "termpool-test-iptables:bookworm"
    dockerfile = (
        f"FROM {base_image}\nRUN apt-get update -q && DEBIAN_FRONTEND=noninteractive "
        "apt-get install -y -q --no-install-recommends iptables && rm -rf /var/lib/apt/lists/*\n"
    )
    try:
        docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
    except docker.errors.BuildError as exc:
        pytest.skip(f"cannot install iptables in an image here (no Debian mirror?): {exc}")
    return tag


def test_a_worker_in_a_container_installs_rules_through_the_host(image_with_iptables, tmp_path):
    """The compose deployment's path: no iptables in the worker's container, so a container of
    its image on the host's network, with NET_ADMIN, runs the script."""
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (root) to check the result")
    guard = Guard("probe-" + uuid.uuid4().hex[:8], (free_port(),), (), ("docker0",))

    def listed() -> str:
        return subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout

    try:
        for _ in range(2):  # the second time replaces the first's rules
            containment._run_on_host(containment.script(guard, guard.comment), image_with_iptables)
            assert listed().count(guard.comment) == len(containment.rules(guard, "iptables"))
            assert f"--dports {guard.local_ports[0]} " in listed()
    finally:
        containment._run_on_host(containment.script(None, guard.comment), image_with_iptables)
    assert guard.comment not in listed()


def test_own_bridges_names_the_host_interfaces(base_image, docker_client):
    network = docker_client.networks.create("tp-contain-" + uuid.uuid4().hex[:8], driver="bridge")
    container = None
    try:
        container = docker_client.containers.run(base_image, ["sleep", "60"], detach=True, network=network.name)
        container.reload()
        [bridge] = containment.own_bridges(container)
        assert bridge == "br-" + network.id[:12]
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode == 0
    finally:
        if container is not None:
            container.remove(force=True)
        network.remove()


@pytest.mark.unit
def test_redis_in_termpools_own_network_gets_no_address_rule():
    """Redis as a compose service: the reject into termpool's bridge covers it; an address rule
    would outlive the network and cut off the next pool given that address."""
    cfg = load_settings({"REDIS_URL": "redis://192.168.176.2:6379/0", "CONTAINMENT_BLOCK": "192.0.2.9:80"})
    guard = containment.guard_from_settings(cfg, ("br-own",), ("192.168.176.0/20",))
    assert guard.remote == (("192.0.2.9", 80),)
    assert containment.guard_from_settings(cfg).remote[0] == ("192.168.176.2", 6379)


def test_rules_of_a_pool_whose_bridge_is_gone_are_collected():
    """A compose deployment taken down leaves its rules; the next pool's apply removes them,
    and only them."""
    if shutil.which("iptables") is None or subprocess.run(["iptables", "-S"], capture_output=True).returncode:
        pytest.skip("needs iptables (root)")
    gone = Guard("gone-" + uuid.uuid4().hex[:8], (free_port(),), (("192.0.2.7", 6379),), ("docker0",), ("br-tpgone0",))
    kept = Guard("kept-" + uuid.uuid4().hex[:8], (free_port(),), (), ("docker0",))

    def listed() -> str:
        return subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout

    try:
        containment._run_local(containment.script(gone, gone.comment))
        assert listed().count(gone.comment) == len(containment.rules(gone, "iptables"))
        containment._run_local(containment.script(kept, kept.comment))
        assert gone.comment not in listed()
        containment._run_local(containment.script(kept, kept.comment))  # a pool on the host is kept
        assert listed().count(kept.comment) == len(containment.rules(kept, "iptables"))
    finally:
        for guard in (gone, kept):
            containment._run_local(containment.script(None, guard.comment))
