"""The networks a run's containers sit on, apart from every other run's.

* One-service runs (the SDK fast path, warm spares, their forks) join a termpool bridge whose
  inter-container traffic is off (Docker's `enable_icc=false`): each reaches the outside
  through the bridge's gateway, as on docker0, but not another container on the bridge.
  containment.py rejects the same traffic with a reset, so a scan fails at once instead of
  timing out. A Linux bridge takes at most 1024 ports, so the bridges are shards: a start
  joins the first with fewer than ISOLATED_BRIDGE_SIZE containers (at most 1000: starts in
  flight at once stay within the rest).
* Compose runs get a network of their own per task network (Docker keeps bridges apart), each
  with a block of the host's RUN_SUBNETS (poolcore/subnets.py) instead of one of Docker's own
  pools, which hold about 30 networks. `foreign_subnets` lists what else on the host uses
  addresses, so a worker reserves the blocks that would clash.

The shard bridges belong to the daemon, not to a run or a pool: no teardown or reconcile
removes them, as none removes docker0.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from pathlib import Path

import docker.errors

from environments.docker_client import HOST_LABEL, RUN_LABEL, docker_client

ISOLATED_NAME = "termpool-isolated-{shard}"
ISOLATED_LABEL = "termpool.isolated"
BRIDGE_PREFIX = "br-tpi"  # the shards' interfaces: br-+ is a task interface (containment.py)
ROUTES = Path("/proc/net/route")


@functools.lru_cache(maxsize=8)
def _daemon_tag(base_url: str) -> str:
    """Four hex digits naming the daemon: two daemons on one kernel (a test's second worker
    host) must not name their bridges alike, interface names being per network namespace (the
    second would take over the first's bridge, and remove it with its own network). Their ids
    can be equal (dockerd 20.10 keeps it in /etc/docker/key.json, whatever the data root), so
    the data root goes in too."""
    info = docker_client().info()
    return hashlib.sha256(f"{info.get('ID')} {info.get('DockerRootDir')} {base_url}".encode()).hexdigest()[:4]


def bridge_name(shard: int) -> str:
    return f"{BRIDGE_PREFIX}{_daemon_tag(docker_client().api.base_url)}-{shard}"  # 15 characters at most


def isolated_network(size: int) -> str:
    """The name of the first shard bridge with room for another container (made if missing)."""
    client = docker_client()
    for shard in itertools.count():
        name = ISOLATED_NAME.format(shard=shard)
        if len(_shard(client, name, shard).attrs.get("Containers") or {}) < size:
            return name
    raise AssertionError("unreachable")


def _shard(client, name: str, shard: int):
    try:
        return client.networks.get(name)
    except docker.errors.NotFound:
        pass
    try:
        return client.networks.create(
            name,
            driver="bridge",
            check_duplicate=True,
            labels={ISOLATED_LABEL: "1"},
            options={
                "com.docker.network.bridge.enable_icc": "false",
                "com.docker.network.bridge.name": bridge_name(shard),
            },
        )
    except docker.errors.APIError as exc:
        # Another worker made it meanwhile: 409 for the name, 403 for the bridge's name.
        if exc.status_code not in (403, 409):
            raise
        try:
            return client.networks.get(name)
        except docker.errors.NotFound:
            raise exc from None


def foreign_subnets(host: str) -> list[tuple[str, str]]:
    """(CIDR, what uses it) for every IPv4 network on this machine that is not a run's of this
    host: Docker's other networks (another pool's on the same daemon too) and the routes of
    this network namespace (default routes aside)."""
    found, ours = [], set()
    for network in docker_client().networks.list():
        attrs = network.attrs or {}
        labels = attrs.get("Labels") or {}
        if labels.get(RUN_LABEL) and labels.get(HOST_LABEL) == host:
            ours.add((attrs.get("Options") or {}).get("com.docker.network.bridge.name") or f"br-{network.id[:12]}")
            continue
        for entry in (attrs.get("IPAM") or {}).get("Config") or []:
            if entry.get("Subnet"):
                found.append((entry["Subnet"], f"Docker network {attrs.get('Name', network.id[:12])}"))
    for iface, cidr in routes():
        if iface not in ours:
            found.append((cidr, f"the route to {cidr} on {iface}"))
    return found


def routes(text: str | None = None) -> list[tuple[str, str]]:
    """(interface, CIDR) of each IPv4 route but the default ones, from /proc/net/route."""
    text = ROUTES.read_text() if text is None else text
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        prefix = bin(int(fields[7], 16)).count("1")  # the mask's bits
        if prefix:
            out.append((fields[0], f"{_address(fields[1])}/{prefix}"))
    return out


def _address(little_endian_hex: str) -> str:
    """/proc/net/route's addresses are 32-bit hex in host (little-endian) order."""
    raw = int(little_endian_hex, 16).to_bytes(4, "little")
    return ".".join(str(b) for b in raw)
