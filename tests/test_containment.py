"""Task containers reach no port of their worker host -- the pool's API, Redis and Flower included --
but the ones CONTAINMENT_HOST_ALLOW names (environments/containment.py), yet still reach their
sidecars and the outside."""

from __future__ import annotations

import errno
import io
import ipaddress
import shlex
import shutil
import socket
import subprocess
import time
import uuid

import docker.errors
import pytest

from devstack import free_port
from environments import compose_config, containment
from environments.containment import Guard
from poolcore.config import load_settings
from poolcore.failures import TaskUnsupported
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
def test_rules_refuse_every_host_port_but_the_allowed_and_exempt_own_bridge():
    guard = Guard(
        "p",
        (18081, 6379),
        (("192.0.2.7", 6379), ("fd00::7", None)),
        ("docker0",),
        ("br-own",),
        allow=(("tcp", 5000, 5000), ("udp", 9000, 9010), ("icmp", 0, 0)),
    )
    v4 = [(chain, " ".join(rule)) for chain, rule in containment.rules(guard, "iptables")]
    tag = "-m comment --comment termpool:p"
    reset = "-j REJECT --reject-with tcp-reset"
    assert v4[:7] == [
        ("TERMPOOL-INPUT", f"-i br-own {tag} -j RETURN"),
        ("TERMPOOL-FORWARD", f"-i br-own {tag} -j RETURN"),
        ("TERMPOOL-INPUT", f"-m conntrack --ctstate RELATED,ESTABLISHED {tag} -j RETURN"),
        ("TERMPOOL-INPUT", f"-i docker0 -p tcp -m tcp --dport 5000 {tag} -j RETURN"),
        (
            "TERMPOOL-FORWARD",
            f"-i docker0 -p tcp -m conntrack --ctstate DNAT --ctdir ORIGINAL --ctorigdstport 5000 {tag} -j RETURN",
        ),
        ("TERMPOOL-INPUT", f"-i docker0 -p udp -m udp --dport 9000:9010 {tag} -j RETURN"),
        (
            "TERMPOOL-FORWARD",
            f"-i docker0 -p udp -m conntrack --ctstate DNAT --ctdir ORIGINAL --ctorigdstport 9000:9010 {tag} -j RETURN",
        ),
    ]
    assert v4[7] == ("TERMPOOL-INPUT", f"-i docker0 -p icmp -m icmp --icmp-type echo-request {tag} -j RETURN")
    # Past the openings: every port and protocol of the host refused, and no opening after a reject.
    assert v4[8:10] == [
        ("TERMPOOL-INPUT", f"-i docker0 -p tcp {tag} {reset}"),
        ("TERMPOOL-INPUT", f"-i docker0 {tag} -j REJECT"),
    ]
    assert not any(rule.endswith("RETURN") for _, rule in v4[8:])
    published = "-m conntrack --ctstate DNAT --ctdir ORIGINAL"
    assert ("TERMPOOL-FORWARD", f"-i docker0 {published} -p tcp {tag} {reset}") in v4
    assert ("TERMPOOL-FORWARD", f"-i docker0 {published} {tag} -j REJECT") in v4
    assert ("TERMPOOL-FORWARD", f"-i docker0 -d 192.0.2.7 -p tcp --dport 6379 {tag} {reset}") in v4
    assert ("TERMPOOL-FORWARD", f"-i docker0 -o br-own {tag} -j REJECT") in v4
    assert not any("fd00::7" in rule for _, rule in v4)
    v6 = [" ".join(rule) for _, rule in containment.rules(guard, "ip6tables")]
    assert f"-i docker0 -d fd00::7 {tag} -j REJECT" in v6
    assert f"-p ipv6-icmp -m icmp6 --icmpv6-type neighbour-solicitation {tag} -j RETURN" in v6  # IPv6 needs it
    assert f"-i docker0 -p ipv6-icmp -m icmp6 --icmpv6-type echo-request {tag} -j RETURN" in v6


@pytest.mark.unit
def test_the_script_puts_openings_above_every_pools_rejects_and_swaps_without_a_gap():
    guard = Guard("p", (18081,), (), ("docker0",), ("br-own",), allow=(("tcp", 5000, 5000),))
    lines = [line.strip() for line in containment.script(guard, guard.comment).splitlines()]
    v4 = lines[: lines.index("fi")]
    inserted = [line for line in v4 if " -I TERMPOOL-" in line]
    appended = [line for line in v4 if " -A TERMPOOL-" in line]
    assert all(line.endswith("-j RETURN") for line in inserted) and inserted
    assert not any(line.endswith("-j RETURN") for line in appended) and appended
    # Inserted at the top one by one, last first: they end up in rules()' order.
    expected = [" ".join(rule) for _, rule in containment.rules(guard, "iptables") if rule[-1] == "RETURN"]
    assert [line.split(" 1 ", 1)[1] for line in reversed(inserted)] == expected
    # The old rules are listed before the new go in, and deleted only after.
    listed = next(i for i, line in enumerate(v4) if line.startswith("old=$("))
    deleted = next(i for i, line in enumerate(v4) if '"$old"' in line)
    assert listed < v4.index(inserted[0]) and v4.index(appended[-1]) < deleted
    removal = containment.script(None, guard.comment)
    assert " -I TERMPOOL-" not in removal and " -A TERMPOOL-" not in removal and '"$old"' in removal


@pytest.mark.unit
def test_host_allow_setting_is_parsed_and_never_opens_termpools_own_ports():
    cfg = load_settings(
        {
            "CONTAINMENT_HOST_ALLOW": "5000, 18000-18100/tcp, 53/udp, icmp",
            "ENV_SERVER_PORT": "18081",
            "FLOWER_PORT": "5555",
            "REDIS_URL": "redis://127.0.0.1:6379/0",
        }
    )
    assert cfg.containment_host_allow == (
        ("tcp", 5000, 5000),
        ("udp", 5000, 5000),
        ("tcp", 18000, 18100),
        ("udp", 53, 53),
        ("icmp", 0, 0),
    )
    guard = containment.guard_from_settings(cfg)
    assert ("tcp", 18000, 18080) in guard.allow and ("tcp", 18082, 18100) in guard.allow
    assert not [a for a in guard.allow if a[0] == "tcp" and a[1] <= 18081 <= a[2]]
    assert load_settings({}).containment_host_allow == ()
    for bad in ("0", "65536", "9-8", "80/icmp", "80:90", "ssh"):
        with pytest.raises(ValueError, match="CONTAINMENT_HOST_ALLOW"):
            load_settings({"CONTAINMENT_HOST_ALLOW": bad})


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
            sock.listen(512)  # never accepted: room for a probe from every address
            self.socks.append(sock)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


@pytest.fixture(scope="module")
def contained(base_image, docker_client):
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables (root)")
    flower = free_port()  # nothing serves it: the test listens there itself
    allowed = free_port()
    env = {"CONTAINMENT": "require", "FLOWER_PORT": str(flower), "CONTAINMENT_HOST_ALLOW": str(allowed)}
    for stack in private_stack(docker_client, env):
        stack.flower_port = flower
        stack.allowed_port = allowed
        yield stack  # Stack.stop() removes the rules


class Datagrams:
    """A UDP socket on every host address (0.0.0.0) that gathers what arrives."""

    def __init__(self, port: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", port))
        self.sock.settimeout(0.5)

    def received(self, seconds: float = 3.0) -> set[str]:
        got, deadline = set(), time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                got.add(self.sock.recv(256).decode().strip())
            except TimeoutError:
                continue
        return got

    def close(self) -> None:
        self.sock.close()


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
def test_task_container_reaches_no_host_port_but_the_allowed(contained, docker_client, task):
    stack = contained
    router = Router(stack)
    lease = router.allocate(task)
    listeners = Listeners()
    allowed, other = stack.allowed_port, free_port()  # `other`: an operator's service, say a registry
    datagrams = [Datagrams(allowed), Datagrams(other)]
    try:
        assert router.reset(lease, task).status_code == 200
        gateway = _gateway(docker_client, router, lease)
        addresses = sorted(set(_host_ipv4()) | {gateway})
        listeners.open(other, ["0.0.0.0"])  # every address of the host, as a registry listens
        listeners.open(allowed, ["0.0.0.0"])
        listeners.open(stack.redis_port, addresses)  # the stack's Redis listens on 127.0.0.1 only
        listeners.open(stack.flower_port, addresses)
        addresses = [a for a in addresses if a not in listeners.gone]
        ports = (stack.port, stack.redis_port, stack.flower_port, other, allowed)
        reach = _probe(router, lease, [(a, p) for a in addresses for p in ports])
        assert not [t for t, ok in reach.items() if ok and t[1] != allowed], reach
        missing = [a for a in addresses if not reach[(a, allowed)] and a in _host_ipv4() + [gateway]]
        assert not missing, (missing, reach)  # the probe works: the rules let it through
        sends = " ".join(f"{a}:{p}" for a in addresses for p in (allowed, other))
        router.sh(lease, f'for t in {sends}; do echo "$t" > "/dev/udp/${{t%:*}}/${{t##*:}}"; done; true')
        arrived = datagrams[0].received()
        present = (set(_host_ipv4()) | {gateway}) & set(addresses)  # a bridge of another stack may go meanwhile
        assert {f"{a}:{allowed}" for a in present} <= arrived <= {f"{a}:{allowed}" for a in addresses}
        assert datagrams[1].received(1.0) == set(), "UDP to a port not allowed arrived"
        assert _pinged(router, lease, ["127.0.0.1", gateway]) == {"127.0.0.1": True, gateway: False}
        if task == "sidecar-kv":
            assert _probe(router, lease, [("kv", 8000)]) == {("kv", 8000): True}
        if _reachable("deb.debian.org", 80):  # name resolution and the outside still work
            assert _probe(router, lease, [("deb.debian.org", 80)]) == {("deb.debian.org", 80): True}
    finally:
        listeners.close()
        for socks in datagrams:
            socks.close()
        router.close(lease)
        assert wait_for(lambda: not router.run_containers(docker_client, lease), 60), "teardown did not finish"


PING = """
import socket, sys
for host in sys.argv[1:]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(2)
        try:
            sock.sendto(bytes([8, 0, 0, 0, 0, 0, 0, 1]) + b"probe", (host, 0))
            print(host, sock.recv(64)[0] == 0)
        except OSError:
            print(host, False)
"""


def _pinged(router: Router, lease: str, hosts: list[str]) -> dict:
    """ICMP echo from the task's container (an unprivileged ping socket): {host: True if it answered}."""
    out = router.sh(lease, f"python3 -c {shlex.quote(PING)} {' '.join(hosts)}")
    return {host: answered == "True" for host, answered in (line.split() for line in out.splitlines())}


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
    port = free_port()
    # An interface no traffic arrives on: this checks the bookkeeping, and refuses nobody meanwhile.
    guard = Guard("probe-" + uuid.uuid4().hex[:8], (free_port(),), (), ("tpprobe+",), allow=(("tcp", port, port),))

    def listed() -> str:
        return subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout

    try:
        for _ in range(2):  # the second time replaces the first's rules
            containment.run_on_host(containment.script(guard, guard.comment), image_with_iptables)
            assert listed().count(guard.comment) == len(containment.rules(guard, "iptables"))
            assert f"--dport {port} " in listed()
    finally:
        containment.run_on_host(containment.script(None, guard.comment), image_with_iptables)
    assert guard.comment not in listed()


def test_an_installer_left_behind_is_removed_by_the_next(image_with_iptables, docker_client):
    """A worker stopped between its installer's end and the removal leaves an exited container:
    the next install removes it."""
    label = {containment.INSTALLER_LABEL: "1"}
    left = docker_client.containers.run(image_with_iptables, ["true"], labels=label, detach=True)
    left.wait(timeout=60)
    containment.run_on_host("true", image_with_iptables)
    assert not docker_client.containers.list(all=True, filters={"id": left.id})


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
    gone = Guard("gone-" + uuid.uuid4().hex[:8], (free_port(),), (("192.0.2.7", 6379),), ("tpprobe+",), ("br-tpgone0",))
    kept = Guard("kept-" + uuid.uuid4().hex[:8], (free_port(),), (), ("tpprobe+",))

    def listed() -> str:
        return subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout

    try:
        containment.run_local(containment.script(gone, gone.comment))
        assert listed().count(gone.comment) == len(containment.rules(gone, "iptables"))
        containment.run_local(containment.script(kept, kept.comment))
        assert gone.comment not in listed()
        containment.run_local(containment.script(kept, kept.comment))  # a pool on the host is kept
        assert listed().count(kept.comment) == len(containment.rules(kept, "iptables"))
    finally:
        for guard in (gone, kept):
            containment.run_local(containment.script(None, guard.comment))


def test_pools_sharing_the_chains_keep_every_opening_above_every_reject():
    """Two pools on one host: each one's exempt bridge and allowed port stay open past the
    other's reject-all, a re-apply keeps the layout, and one pool's removal leaves the other's."""
    if shutil.which("iptables") is None or subprocess.run(["iptables", "-S"], capture_output=True).returncode:
        pytest.skip("needs iptables (root)")
    port = free_port()
    first = Guard(
        "one-" + uuid.uuid4().hex[:8], (free_port(),), (), ("tpprobe+",), ("tpown1",), allow=(("tcp", port, port),)
    )
    second = Guard("two-" + uuid.uuid4().hex[:8], (free_port(),), (), ("tpprobe+",), ("tpown2",))
    ours = (first.comment, second.comment)

    def chain(name: str) -> list[str]:
        lines = subprocess.run(["iptables", "-S", name], capture_output=True, text=True, check=True).stdout
        return [line for line in lines.splitlines() if any(f'"{c}"' in line or f"{c} " in line for c in ours)]

    def openings_first(name: str) -> bool:
        kinds = [line.endswith("-j RETURN") for line in chain(name)]
        return kinds == sorted(kinds, reverse=True) and True in kinds and False in kinds

    try:
        for guard in (first, second, first):  # the last: a re-apply of a pool below another
            containment.run_local(containment.script(guard, guard.comment))
            assert openings_first("TERMPOOL-INPUT") and openings_first("TERMPOOL-FORWARD")
        assert any(f"-i tpprobe+ -p tcp -m tcp --dport {port} " in line for line in chain("TERMPOOL-INPUT"))
        containment.run_local(containment.script(None, first.comment))
        left = chain("TERMPOOL-INPUT") + chain("TERMPOOL-FORWARD")
        assert not any(first.comment in line for line in left)
        assert len(left) == len(containment.rules(second, "iptables"))
    finally:
        for guard in (first, second):
            containment.run_local(containment.script(None, guard.comment))
