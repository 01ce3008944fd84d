"""Keep task containers away from their worker host: packet-filter rules, deny by default.

Task code is hostile: from a task container, no port of its worker host may answer -- not the
pool API, Flower or Redis (with the API it could allocate, exec on or close other runs), not a
registry the pool pushes images to (a task that pushed would poison every host), not an
operator's own services -- unless CONTAINMENT_HOST_ALLOW names it. Docker already isolates
networks from each other; what remains is the host itself (the bridge gateway and every other
host address, over any protocol), ports Docker publishes on the host, and services on other
machines. At worker start, this module installs, idempotently, per pool (each rule is tagged
with POOL_HOST_ID in its comment; the layout is in environments/containment_rules.py):

  TERMPOOL-INPUT    (jumped to first from INPUT): traffic from a task interface (docker0,
                    br-+: where Docker's bridges, so task containers, are) to the host itself
                    is refused, whatever its port or protocol (ICMP echo too), except replies
                    to connections the host opened, IPv6 neighbour discovery and the
                    CONTAINMENT_HOST_ALLOW ports.
  TERMPOOL-FORWARD  (jumped to first from DOCKER-USER, else FORWARD): from a task interface,
                    connections to ports Docker publishes on the host (DNAT-ed) except allowed
                    ones, to Redis when it lives elsewhere, to CONTAINMENT_BLOCK destinations,
                    and into termpool's own Docker networks (the compose deployment) are
                    refused; so is traffic between two ports of the bridges one-service runs
                    share (environments/networks.py: inter-container traffic is off there
                    already), and traffic routed between task bridges.

Task containers still reach the outside (forwarded, not input) and their sidecars. Name
resolution keeps working: Docker's embedded DNS (127.0.0.11) lives in the container's own
network namespace and asks the host's upstream servers from there or from dockerd, neither of
which is traffic into the host from a task interface -- unless the host's resolver listens on
one of the host's own non-loopback addresses, which then takes `53` in CONTAINMENT_HOST_ALLOW.
Every other container on a task interface loses the host's ports too: a worker host is the
pool's. Termpool's own bridges (when the worker runs in a container) are exempt, so its
services still reach each other. Rejects are TCP resets, else ICMP port-unreachable, so a
probe fails at once instead of hanging. Both iptables and ip6tables.

Rules go in with `iptables` where the worker runs it (root on the host); a worker in termpool's
container (the compose deployment) has no iptables of its own, so a short-lived container of
its image on the host's network with NET_ADMIN runs the script. Either way under a lock file in
POOL_SOCKET_DIR (a host folder, mounted at the same path in worker containers), so workers
starting together do not interleave. `python -m environments.containment apply|remove|show`.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from environments import networks
from environments.containment_rules import Guard, comment_for, rules, safe_tag, script, without_ports
from poolcore.config import Settings, settings
from poolcore.state import connection

log = logging.getLogger(__name__)

__all__ = ["Guard", "guard_from_settings", "install", "remove", "rules", "script"]

LOCK_NAME = ".containment.lock"  # in POOL_SOCKET_DIR
INSTALLER_LABEL = "termpool.containment-installer"  # the containers run_on_host starts


def _is_local(host: str) -> bool:
    """The name resolves to an address of this machine (or its network namespace)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        try:
            with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET) as sock:
                sock.bind((str(ip), 0))  # only an address of ours can be bound
            return True
        except OSError:
            continue
    return False


def _resolve(host: str) -> list[str]:
    try:
        return sorted({info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)})
    except OSError:
        log.warning("containment: cannot resolve %s; it is not blocked", host)
        return []


def parse_destination(entry: str) -> list[tuple[str, int | None]]:
    """One CONTAINMENT_BLOCK entry: `host`, `host:port`, `[v6]:port`, or a CIDR."""
    entry = entry.strip()
    try:
        return [(str(ipaddress.ip_network(entry, strict=False)), None)]
    except ValueError:
        pass
    parts = urlsplit("//" + entry)
    host, port = parts.hostname, parts.port
    if not host:
        raise ValueError(f"CONTAINMENT_BLOCK entry {entry!r} is not host[:port] or a CIDR")
    return [(address, port) for address in _resolve(host)]


def guard_from_settings(cfg: Settings, exempt: tuple[str, ...] = (), own_subnets: tuple[str, ...] = ()) -> Guard:
    """The pool's API and Flower ports; each Redis server (and sentinel) as a local port or a
    remote address; the host ports CONTAINMENT_HOST_ALLOW lets through, less termpool's own
    (a range that spans one is cut around it: no setting opens the pool). A remote address inside one of termpool's own networks (`own_subnets`:
    Redis as a compose service) gets no rule of its own: the reject into termpool's bridges
    covers it, and an address rule would outlive the network and cut off whichever pool's
    Redis is given that address next."""
    ports = {cfg.port, cfg.flower_port}
    remote: list[tuple[str, int | None]] = []
    for host, port in connection.endpoints(cfg):  # the one Redis, or sentinels and their servers
        if _is_local(host):
            ports.add(port)
        else:
            remote += [(address, port) for address in _resolve(host)]
    for entry in cfg.containment_block:
        remote += parse_destination(entry)
    remote = [(address, port) for address, port in remote if not _inside(address, own_subnets)]
    allow = without_ports(cfg.containment_host_allow, ports)
    if allow != cfg.containment_host_allow:
        log.warning(
            "containment: CONTAINMENT_HOST_ALLOW spans termpool's own ports %s; they stay closed", sorted(ports)
        )
    return Guard(
        tag=safe_tag(cfg.host_id),
        local_ports=tuple(sorted(ports)),
        remote=tuple(remote),
        interfaces=cfg.containment_interfaces,
        exempt=exempt,
        isolated=f"{networks.BRIDGE_PREFIX}+",
        allow=allow,
    )


def _inside(address: str, subnets: tuple[str, ...]) -> bool:
    target = ipaddress.ip_network(address, strict=False)
    for subnet in subnets:
        network = ipaddress.ip_network(subnet, strict=False)
        if network.version == target.version and target.subnet_of(network):
            return True
    return False


# ---- running it -----------------------------------------------------------------------------
def run_local(text: str) -> None:
    proc = subprocess.run(["sh", "-c", text], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"installing packet-filter rules failed: {proc.stderr.strip() or proc.stdout.strip()}")


def _own_container():
    """The container of the Docker daemon we drive that this worker runs in (the compose
    deployment: its hostname is its id), or None on the host (or when Docker is unreachable)."""
    import docker.errors

    from environments.docker_client import docker_client

    try:
        return docker_client().containers.get(socket.gethostname())
    except docker.errors.DockerException:
        return None


def run_on_host(text: str, image: str) -> None:
    """Run the script in a container of `image` (which has iptables) on the host's network:
    NET_ADMIN there changes the host's packet filter and nothing else. The container is
    removed once it has run; one left behind by a worker stopped in between (`docker compose
    down` at that moment) is removed by the next install."""
    from environments.docker_client import docker_client

    client = docker_client()
    remove_exited_installers(client)
    client.containers.run(
        image,
        ["sh", "-c", text],
        entrypoint=[],
        remove=True,
        user="root",
        network_mode="host",
        cap_add=["NET_ADMIN", "NET_RAW"],
        labels={INSTALLER_LABEL: "1"},
    )


def remove_exited_installers(client) -> None:
    """Installer containers that ran to their end and were not removed (their worker stopped
    after the run, before the removal). A running one is another worker's install: left alone."""
    import docker.errors

    found = client.containers.list(
        all=True, filters={"label": INSTALLER_LABEL, "status": "exited"}, ignore_removed=True
    )
    for container in found:
        try:
            container.remove()
        except docker.errors.APIError:  # gone meanwhile, or its own worker removing it right now
            pass


def _own_bridge_networks(container) -> list:
    """The container's own Docker bridge networks, except Docker's default one: task containers
    started without compose live there, it is never exempt."""
    from environments.docker_client import docker_client

    networks = []
    for net in (container.attrs.get("NetworkSettings") or {}).get("Networks", {}).values():
        network = docker_client().networks.get(net["NetworkID"])
        options = network.attrs.get("Options") or {}
        if network.attrs.get("Driver") != "bridge" or options.get("com.docker.network.bridge.default_bridge") == "true":
            continue
        networks.append(network)
    return networks


def own_bridges(container) -> tuple[str, ...]:
    """Bridge interface names of the container's own networks (see _own_bridge_networks)."""
    return tuple(
        (n.attrs.get("Options") or {}).get("com.docker.network.bridge.name", "br-" + n.id[:12])
        for n in _own_bridge_networks(container)
    )


def own_subnets(container) -> tuple[str, ...]:
    """The address ranges of the container's own networks (see _own_bridge_networks)."""
    return tuple(
        config["Subnet"]
        for n in _own_bridge_networks(container)
        for config in ((n.attrs.get("IPAM") or {}).get("Config") or [])
        if config.get("Subnet")
    )


def execute(text: str, lock_dir: Path, container=None) -> None:
    """Run a rules script where it reaches the host's packet filter: here, or for a worker in
    `container` through a container of its image; one at a time per host."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if container is None:
            run_local(text)
        else:
            run_on_host(text, container.image.id)


def install(cfg: Settings) -> Guard | None:
    """Install this pool's rules as CONTAINMENT says (off | on | require); the Guard, or None."""
    if cfg.containment == "off":
        return None
    try:
        container = _own_container()
        own = (own_bridges(container), own_subnets(container)) if container is not None else ((), ())
        guard = guard_from_settings(cfg, *own)
        execute(script(guard, guard.comment), cfg.socket_dir, container)
        log.info(
            "containment: task containers are refused every port of this host but %s, and %s elsewhere",
            [f"{low}-{high}/{protocol}" for protocol, low, high in guard.allow] or "none",
            [f"{a}:{p or '*'}" for a, p in guard.remote] or "nothing",
        )
        return guard
    except Exception as exc:
        if cfg.containment == "require":
            raise
        log.error(
            "containment: rules NOT installed (%s: %s); task containers may reach this host's services "
            "(CONTAINMENT=require makes this fatal, CONTAINMENT=off silences it)",
            type(exc).__name__,
            exc,
        )
        return None


def remove(cfg: Settings) -> None:
    """Remove the pool's rules (the chains and jumps stay: other pools may use them)."""
    execute(script(None, comment_for(safe_tag(cfg.host_id))), cfg.socket_dir, _own_container())


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("apply", "remove", "show"):
        sys.exit("usage: python -m environments.containment apply|remove|show")
    cfg = settings()
    if argv[0] == "remove":
        remove(cfg)
    elif argv[0] == "show":
        guard = guard_from_settings(cfg)
        print(script(guard, guard.comment), end="")
    elif install(cfg) is None:
        sys.exit(1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1:])
