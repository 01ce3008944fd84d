"""The packet-filter rules of environments/containment.py: what they are, and one sh script that
installs or removes a pool's share of them.

Every pool on a host shares the two chains; each rule carries its pool's comment
(`termpool:<POOL_HOST_ID>`). In each chain, every pool's RETURN rules (openings) sit above every
pool's rejects: openings are inserted at the top, rejects appended at the bottom. So a reject-all
of one pool never shadows another pool's exempt bridge or allowed port. The price: a port one
pool allows, every pool's task containers on that host reach (they share docker0 and br-+, the
rules cannot tell them apart).

  TERMPOOL-INPUT    1. RETURN from termpool's own bridges (exempt: the compose deployment)
                    2. RETURN for packets of connections already open (conntrack ESTABLISHED,
                       RELATED): replies to what the host opened (docker-proxy, a check), ICMP
                       errors about them
                    3. ip6tables only: RETURN for neighbour discovery (router and neighbour
                       solicitations, neighbour advertisements), without which IPv6 fails
                    4. RETURN for CONTAINMENT_HOST_ALLOW: host ports (tcp/udp), ICMP echo
                    5. from each task interface: TCP refused with a reset, anything else with an
                       ICMP port-unreachable (ICMP echo included: no ping of the host)
  TERMPOOL-FORWARD  1. RETURN from termpool's own bridges
                    2. RETURN for allowed ports that Docker publishes (DNAT-ed, so forwarded)
                    3. from each task interface: any new connection the host DNAT-ed (a port
                       Docker publishes on the host: the host's port, forwarded), Redis and
                       CONTAINMENT_BLOCK destinations elsewhere, termpool's own bridges: refused
                    4. traffic routed between task bridges, and between two ports of the
                       one-service runs' bridges: refused (Docker drops it silently)
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass

INPUT_CHAIN = "TERMPOOL-INPUT"
FORWARD_CHAIN = "TERMPOOL-FORWARD"
TCP_RESET = ["-j", "REJECT", "--reject-with", "tcp-reset"]  # only for rules matching -p tcp
REJECT = ["-j", "REJECT"]  # any protocol: an ICMP port-unreachable
RETURN = ["-j", "RETURN"]
FAMILIES = ("iptables", "ip6tables")
NEIGHBOUR_DISCOVERY = ("router-solicitation", "neighbour-solicitation", "neighbour-advertisement")


@dataclass(frozen=True)
class Guard:
    """What task containers may reach of this host, what else they may not, and where their
    traffic comes in."""

    tag: str  # the pool (POOL_HOST_ID), in every rule's comment
    local_ports: tuple[int, ...]  # termpool's TCP ports on this host (refused like every port)
    remote: tuple[tuple[str, int | None], ...]  # (address or CIDR, TCP port or None: any)
    interfaces: tuple[str, ...]  # task containers' traffic arrives here (iptables names, + wildcard)
    exempt: tuple[str, ...] = ()  # termpool's own bridges (compose deployment): never filtered
    isolated: str = ""  # one-service runs' bridges (iptables name, + wildcard): no traffic between their ports
    allow: tuple[tuple[str, int, int], ...] = ()  # (tcp | udp | icmp, low, high): host ports let through

    @property
    def comment(self) -> str:
        return comment_for(self.tag)


def safe_tag(host_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host_id)[:200]


def comment_for(tag: str) -> str:
    return f"termpool:{tag}"


def without_ports(allow: tuple, ports) -> tuple:
    """The TCP ranges of `allow` with `ports` (termpool's own) cut out: no setting opens them."""
    out = []
    for protocol, low, high in allow:
        cuts = sorted(p for p in ports if protocol == "tcp" and low <= p <= high)
        for port in cuts:
            if low < port:
                out.append((protocol, low, port - 1))
            low = port + 1
        if low <= high:
            out.append((protocol, low, high))
    return tuple(out)


def is_opening(rule: list[str]) -> bool:
    """A RETURN rule: it goes above every reject (inserted at the chain's top)."""
    return rule[-2:] == RETURN


def rules(guard: Guard, family: str) -> list[tuple[str, list[str]]]:
    """(chain, rule) pairs for one family, openings first; each rule carries the pool's comment."""
    tag = ["-m", "comment", "--comment", guard.comment]
    return _openings(guard, family, tag) + _input_refusals(guard, tag) + _forward_refusals(guard, family, tag)


def _openings(guard: Guard, family: str, tag: list[str]) -> list[tuple[str, list[str]]]:
    out = [(chain, ["-i", bridge, *tag, *RETURN]) for chain in (INPUT_CHAIN, FORWARD_CHAIN) for bridge in guard.exempt]
    out.append((INPUT_CHAIN, ["-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", *tag, *RETURN]))
    if family == "ip6tables":
        out += [
            (INPUT_CHAIN, ["-p", "ipv6-icmp", "-m", "icmp6", "--icmpv6-type", kind, *tag, *RETURN])
            for kind in NEIGHBOUR_DISCOVERY
        ]
    for iface in guard.interfaces:
        for protocol, low, high in guard.allow:
            out += _allowed(iface, protocol, f"{low}:{high}" if low != high else str(low), family, tag)
    return out


def _allowed(iface: str, protocol: str, ports: str, family: str, tag: list[str]) -> list[tuple[str, list[str]]]:
    if protocol == "icmp":
        echo = ["-p", "icmp", "-m", "icmp", "--icmp-type", "echo-request"]
        if family == "ip6tables":
            echo = ["-p", "ipv6-icmp", "-m", "icmp6", "--icmpv6-type", "echo-request"]
        return [(INPUT_CHAIN, ["-i", iface, *echo, *tag, *RETURN])]
    published = ["-m", "conntrack", "--ctstate", "DNAT", "--ctdir", "ORIGINAL", "--ctorigdstport", ports]
    return [
        (INPUT_CHAIN, ["-i", iface, "-p", protocol, "-m", protocol, "--dport", ports, *tag, *RETURN]),
        (FORWARD_CHAIN, ["-i", iface, "-p", protocol, *published, *tag, *RETURN]),
    ]


def _input_refusals(guard: Guard, tag: list[str]) -> list[tuple[str, list[str]]]:
    """Whatever a task interface sends to the host itself, past the openings."""
    out = []
    for iface in guard.interfaces:
        out += _refused(INPUT_CHAIN, ["-i", iface], tag)
    return out


def _forward_refusals(guard: Guard, family: str, tag: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for iface in guard.interfaces:
        # A port Docker publishes on the host is DNAT-ed to its container, so forwarded, not
        # input. Original direction only: replies of a container on this interface that serves
        # a published port to someone else carry the DNAT state too.
        out += _refused(
            FORWARD_CHAIN, ["-i", iface, "-m", "conntrack", "--ctstate", "DNAT", "--ctdir", "ORIGINAL"], tag
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
            out += _refused(
                FORWARD_CHAIN, ["-i", source, "-o", target, "-m", "physdev", "!", "--physdev-is-bridged"], tag
            )
    if guard.isolated:
        out += _refused(FORWARD_CHAIN, ["-i", guard.isolated, "-o", guard.isolated], tag)
    return out


def _family_of(address: str) -> str:
    return "ip6tables" if ipaddress.ip_network(address, strict=False).version == 6 else "iptables"


def _refused(chain: str, match: list[str], tag: list[str]) -> list[tuple[str, list[str]]]:
    """Traffic matching `match` refused: TCP with a reset, the rest with an ICMP error."""
    return [(chain, [*match, "-p", "tcp", *tag, *TCP_RESET]), (chain, [*match, *tag, *REJECT])]


# ---- the script -----------------------------------------------------------------------------
def _listed(ipt: str, pattern: str) -> str:
    """Shell: both chains' rules whose comment matches the (grep -E) pattern, as `-D` takes them."""
    return f"{{ {ipt} -S {INPUT_CHAIN}; {ipt} -S {FORWARD_CHAIN}; }} | grep -E -- {pattern} | cut -c4-"


def _delete_listed(ipt: str, variable: str) -> str:
    """Shell: delete the rules listed in $variable, last first (each `-D` takes the first rule
    that matches: an identical new one in its place keeps the count right). A rule already gone
    is no failure: another pool's script on this host (each pool has its own lock) may have
    swept it as a gone pool's in the meantime; a rule that stays after a failed `-D` is one."""
    return (
        f'printf "%s\\n" "${variable}" | tac | while read -r rule; do '
        f'if [ -n "$rule" ]; then eval "{ipt} -D $rule" 2>/dev/null || ! eval "{ipt} -C $rule" 2>/dev/null; fi; done'
    )


def _drop_gone_pools(ipt: str) -> str:
    """Shell: delete the rules of pools whose own bridge is gone (a compose deployment taken
    down with its rules still in): their rules name an interface that no longer exists, and
    nothing else would ever remove them."""
    returns = f's/^-A {FORWARD_CHAIN} -i \\(br-[^ ]*\\) -m comment --comment "\\{{0,1\\}}termpool:\\([^ "]*\\).* -j RETURN$/\\1 \\2/p'
    pattern = '"--comment \\"?termpool:$pattern\\"?( |\\$)"'
    return (
        f"{ipt} -S {FORWARD_CHAIN} | sed -n {shlex.quote(returns)} | sort -u | while read -r dev tag; do "
        f'[ -e "/sys/class/net/$dev" ] && continue; pattern=$(printf %s "$tag" | sed "s/[.]/[.]/g"); '
        f"gone=$({_listed(ipt, pattern)}); {_delete_listed(ipt, 'gone')}; done"
    )


def script(guard: Guard | None, comment: str) -> str:
    """One sh script that replaces (guard) or removes (None) the pool's rules, in both families.
    The new rules go in before the old ones come out, so a re-apply opens no gap, not even for
    a moment: not for task containers, not in the exempt bridges of termpool's own services."""
    lines = ["set -e"]
    pattern = shlex.quote(f'--comment "?{re.escape(comment)}"?( |$)')
    for family in FAMILIES:
        ipt = f"{family} -w"
        body = [f"{ipt} -N {chain} 2>/dev/null || true" for chain in (INPUT_CHAIN, FORWARD_CHAIN)]
        body += [_drop_gone_pools(ipt), f"old=$({_listed(ipt, pattern)})"]
        new = rules(guard, family) if guard else []
        body += [f"{ipt} -I {chain} 1 {shlex.join(rule)}" for chain, rule in reversed(new) if is_opening(rule)]
        body += [f"{ipt} -A {chain} {shlex.join(rule)}" for chain, rule in new if not is_opening(rule)]
        body.append(_delete_listed(ipt, "old"))
        body.append(f"{ipt} -C INPUT -j {INPUT_CHAIN} 2>/dev/null || {ipt} -I INPUT 1 -j {INPUT_CHAIN}")
        body.append(f"hook=FORWARD; if {ipt} -S DOCKER-USER >/dev/null 2>&1; then hook=DOCKER-USER; fi")
        body.append(f"{ipt} -C $hook -j {FORWARD_CHAIN} 2>/dev/null || {ipt} -I $hook 1 -j {FORWARD_CHAIN}")
        # ip6tables may be missing or without kernel support: then there is no IPv6 to filter.
        required = family == "iptables"
        test = f"command -v {family} >/dev/null && {ipt} -S INPUT >/dev/null 2>&1"
        lines.append(f"if {'true' if required else test}; then\n  " + "\n  ".join(body) + "\nfi")
    return "\n".join(lines) + "\n"
