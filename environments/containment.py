"""Keep task containers away from termpool's own services: packet-filter rules on the worker host.

Task code is hostile: from a task container, the pool API, Flower and Redis of its own pool
must be out of reach (with the API it could allocate, exec on or close other runs). Docker
already isolates networks from each other; what remains is the host itself (the bridge
gateway and every other host address), ports Docker publishes on the host, and services on
other machines. At worker start, this module installs, idempotently, per pool (each rule is
tagged with POOL_HOST_ID in its comment):

  TERMPOOL-INPUT    (jumped to first from INPUT): traffic from a task interface (docker0,
                    br-+: where Docker's bridges, so task containers, are) to termpool's ports
                    on this host -- the API, Flower and, when local, Redis -- is rejected.
  TERMPOOL-FORWARD  (jumped to first from DOCKER-USER, else FORWARD): from a task interface,
                    connections DNAT-ed to one of those ports (ports Docker publishes), to
                    Redis when it lives elsewhere, to CONTAINMENT_BLOCK destinations, and into
                    termpool's own Docker networks (the compose deployment) are rejected; so is
                    traffic between two ports of the bridges one-service runs share
                    (environments/networks.py: inter-container traffic is off there already).

Everything else is left alone: task containers still reach the outside and their sidecars,
other containers on the host only lose termpool's ports. Termpool's own bridges (when the
worker runs in a container) are exempt, so its services still reach each other. Rejects are
TCP resets, so a probe fails at once instead of hanging. Both iptables and ip6tables.

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
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from environments import networks
from termpool.config import Settings, settings
from termpool.state import connection

log = logging.getLogger(__name__)

INPUT_CHAIN = "TERMPOOL-INPUT"
FORWARD_CHAIN = "TERMPOOL-FORWARD"
LOCK_NAME = ".containment.lock"  # in POOL_SOCKET_DIR
TCP_RESET = ["-j", "REJECT", "--reject-with", "tcp-reset"]  # only for rules matching -p tcp
REJECT = ["-j", "REJECT"]  # any protocol: an ICMP port-unreachable
FAMILIES = ("iptables", "ip6tables")


@dataclass(frozen=True)
class Guard:
    """What to keep task containers from reaching, and where their traffic comes in."""

    tag: str  # the pool (POOL_HOST_ID), in every rule's comment
    local_ports: tuple[int, ...]  # termpool's TCP ports on this host
    remote: tuple[tuple[str, int | None], ...]  # (address or CIDR, TCP port or None: any)
    interfaces: tuple[str, ...]  # task containers' traffic arrives here (iptables names, + wildcard)
    exempt: tuple[str, ...] = ()  # termpool's own bridges (compose deployment): never filtered
    isolated: str = ""  # one-service runs' bridges (iptables name, + wildcard): no traffic between their ports

    @property
    def comment(self) -> str:
        return _comment(self.tag)


def _safe_tag(host_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host_id)[:200]


def _comment(tag: str) -> str:
    return f"termpool:{tag}"


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
    remote address. A remote address inside one of termpool's own networks (`own_subnets`:
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
    return Guard(
        tag=_safe_tag(cfg.host_id),
        local_ports=tuple(sorted(ports)),
        remote=tuple(remote),
        interfaces=cfg.containment_interfaces,
        exempt=exempt,
        isolated=f"{networks.BRIDGE_PREFIX}+",
    )


def _inside(address: str, subnets: tuple[str, ...]) -> bool:
    target = ipaddress.ip_network(address, strict=False)
    for subnet in subnets:
        network = ipaddress.ip_network(subnet, strict=False)
        if network.version == target.version and target.subnet_of(network):
            return True
    return False


# ---- the rules ------------------------------------------------------------------------------
def _family_of(address: str) -> str:
    return "ip6tables" if ipaddress.ip_network(address, strict=False).version == 6 else "iptables"


def rules(guard: Guard, family: str) -> list[tuple[str, list[str]]]:
    """(chain, rule) pairs for one family, in order; each rule carries the pool's comment."""
    tag = ["-m", "comment", "--comment", guard.comment]
    out: list[tuple[str, list[str]]] = []
    for chain in (INPUT_CHAIN, FORWARD_CHAIN):
        out += [(chain, ["-i", iface, *tag, "-j", "RETURN"]) for iface in guard.exempt]
    ports = ",".join(str(p) for p in guard.local_ports)
    for iface in guard.interfaces:
        if ports:
            out.append(
                (INPUT_CHAIN, ["-i", iface, "-p", "tcp", "-m", "multiport", "--dports", ports, *tag, *TCP_RESET])
            )
        for port in guard.local_ports:  # published by Docker: DNAT-ed, so forwarded, not input
            out.append(
                (
                    FORWARD_CHAIN,
                    [
                        "-i",
                        iface,
                        "-p",
                        "tcp",
                        "-m",
                        "conntrack",
                        "--ctstate",
                        "DNAT",
                        "--ctorigdstport",
                        str(port),
                        *tag,
                        *TCP_RESET,
                    ],
                )
            )
        for address, port in guard.remote:
            if _family_of(address) != family:
                continue
            match = ["-p", "tcp", "--dport", str(port), *tag, *TCP_RESET] if port else [*tag, *REJECT]
            out.append((FORWARD_CHAIN, ["-i", iface, "-d", address, *match]))
        for bridge in guard.exempt:
            out.append((FORWARD_CHAIN, ["-i", iface, "-o", bridge, *tag, *REJECT]))
    # Runs kept apart: what Docker drops silently (traffic routed from one task bridge to
    # another; between two ports of a one-service runs' bridge, enable_icc=false) is refused
    # here first, so a scan of the neighbours fails at once instead of waiting out each probe.
    for source in guard.interfaces:
        for target in guard.interfaces:
            out += _refused(["-i", source, "-o", target, "-m", "physdev", "!", "--physdev-is-bridged"], tag)
    if guard.isolated:
        out += _refused(["-i", guard.isolated, "-o", guard.isolated], tag)
    return out


def _refused(match: list[str], tag: list[str]) -> list[tuple[str, list[str]]]:
    """Forwarded traffic matching `match` refused: TCP with a reset, the rest with an ICMP error."""
    return [(FORWARD_CHAIN, [*match, "-p", "tcp", *tag, *TCP_RESET]), (FORWARD_CHAIN, [*match, *tag, *REJECT])]


def _drop_tagged(ipt: str, chain: str, comment: str) -> str:
    """Shell: delete the chain's rules that carry this comment (as `-S` prints them), last
    first: what is left is always a head of the old list, so the RETURN rules of termpool's
    own bridges outlive the rejects behind them and a re-apply never cuts termpool's services
    off from each other, not even for a moment."""
    pattern = shlex.quote(f'--comment "?{re.escape(comment)}"?( |$)')
    return (
        f'{ipt} -S {chain} | grep -E -- {pattern} | cut -c4- | tac | while read -r rule; do eval "{ipt} -D $rule"; done'
    )


def _drop_gone_pools(ipt: str) -> str:
    """Shell: delete the rules of pools whose own bridge is gone (a compose deployment taken
    down with its rules still in): their rules name an interface that no longer exists, and
    nothing else would ever remove them."""
    returns = f's/^-A {FORWARD_CHAIN} -i \\(br-[^ ]*\\) -m comment --comment "\\{{0,1\\}}termpool:\\([^ "]*\\).* -j RETURN$/\\1 \\2/p'
    drop = " ".join(
        f'{ipt} -S {chain} | grep -E -- "--comment \\"?termpool:$pattern\\"?( |\\$)" | cut -c4- | tac '
        f'| while read -r rule; do eval "{ipt} -D $rule"; done;'
        for chain in (INPUT_CHAIN, FORWARD_CHAIN)
    )
    return (
        f"{ipt} -S {FORWARD_CHAIN} | sed -n {shlex.quote(returns)} | sort -u | while read -r dev tag; do "
        f'[ -e "/sys/class/net/$dev" ] && continue; pattern=$(printf %s "$tag" | sed "s/[.]/[.]/g"); {drop} done'
    )


def script(guard: Guard | None, comment: str) -> str:
    """One sh script that replaces (guard) or removes (None) the pool's rules, in both families."""
    lines = ["set -e"]
    for family in FAMILIES:
        ipt = f"{family} -w"
        body = []
        for chain in (INPUT_CHAIN, FORWARD_CHAIN):
            body.append(f"{ipt} -N {chain} 2>/dev/null || true")
        body.append(_drop_gone_pools(ipt))
        for chain in (INPUT_CHAIN, FORWARD_CHAIN):
            body.append(_drop_tagged(ipt, chain, comment))
        for chain, rule in rules(guard, family) if guard else []:
            body.append(f"{ipt} -A {chain} {shlex.join(rule)}")
        body.append(f"{ipt} -C INPUT -j {INPUT_CHAIN} 2>/dev/null || {ipt} -I INPUT 1 -j {INPUT_CHAIN}")
        body.append(f"hook=FORWARD; if {ipt} -S DOCKER-USER >/dev/null 2>&1; then hook=DOCKER-USER; fi")
        body.append(f"{ipt} -C $hook -j {FORWARD_CHAIN} 2>/dev/null || {ipt} -I $hook 1 -j {FORWARD_CHAIN}")
        # ip6tables may be missing or without kernel support: then there is no IPv6 to filter.
        required = family == "iptables"
        test = f"command -v {family} >/dev/null && {ipt} -S INPUT >/dev/null 2>&1"
        lines.append(f"if {'true' if required else test}; then\n  " + "\n  ".join(body) + "\nfi")
    return "\n".join(lines) + "\n"


# ---- running it -----------------------------------------------------------------------------
def _run_local(text: str) -> None:
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


def _run_on_host(text: str, image: str) -> None:
    """Run the script in a container of `image` (which has iptables) on the host's network:
    NET_ADMIN there changes the host's packet filter and nothing else."""
    from environments.docker_client import docker_client

    docker_client().containers.run(
        image,
        ["sh", "-c", text],
        entrypoint=[],
        remove=True,
        user="root",
        network_mode="host",
        cap_add=["NET_ADMIN", "NET_RAW"],
    )


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
            _run_local(text)
        else:
            _run_on_host(text, container.image.id)


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
            "containment: task containers are refused ports %s of this host and %s elsewhere",
            guard.local_ports,
            [f"{a}:{p or '*'}" for a, p in guard.remote] or "nothing",
        )
        return guard
    except Exception as exc:
        if cfg.containment == "require":
            raise
        log.error(
            "containment: rules NOT installed (%s: %s); task containers may reach termpool's services "
            "(CONTAINMENT=require makes this fatal, CONTAINMENT=off silences it)",
            type(exc).__name__,
            exc,
        )
        return None


def remove(cfg: Settings) -> None:
    """Remove the pool's rules (the chains and jumps stay: other pools may use them)."""
    execute(script(None, _comment(_safe_tag(cfg.host_id))), cfg.socket_dir, _own_container())


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
