"""termpool's own address range for run networks (RUN_SUBNETS, split into RUN_SUBNET_PREFIX
blocks): pure arithmetic, shared by the workers (which allocate and check) and the settings.

Docker's default address pools hold about 30 bridge networks per daemon, so a host that let
Docker choose stopped at about 30 live compose runs. Each network of a run instead gets a
block of this range by index (0 .. count-1); Redis records which run holds which index
(poolcore/state/subnets.py), so a host holds as many networks as the range has blocks.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

MAX_BLOCKS = 4096  # more would make the allocator's scan (a Lua loop over the blocks) slow
MAX_PREFIX = 29  # a /29 holds 5 containers and the gateway: the smallest useful network


@dataclass(frozen=True)
class SubnetRange:
    cidr: str  # the whole range, e.g. 10.240.0.0/16
    prefix: int  # each run network's block, e.g. 26 (62 addresses)

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.cidr)

    @property
    def count(self) -> int:
        return 1 << (self.prefix - self.network.prefixlen)

    def subnet(self, index: int) -> str:
        if not 0 <= index < self.count:
            raise IndexError(f"block {index} is outside {self.cidr} in /{self.prefix} blocks")
        size = 1 << (32 - self.prefix)
        return f"{self.network.network_address + index * size}/{self.prefix}"

    def overlapping(self, networks: Iterable[str]) -> set[int]:
        """Indices of the blocks that overlap any of these networks (IPv4 CIDRs; others ignored)."""
        found: set[int] = set()
        size = 1 << (32 - self.prefix)
        base = int(self.network.network_address)
        for text in networks:
            try:
                other = ipaddress.ip_network(text, strict=False)
            except ValueError:
                continue
            if other.version != 4 or not other.overlaps(self.network):
                continue
            first = max(int(other.network_address), base)
            last = min(int(other.broadcast_address), base + self.count * size - 1)
            found.update(range((first - base) // size, (last - base) // size + 1))
        return found


def parse(cidr: str, prefix: int) -> SubnetRange:
    """The RUN_SUBNETS / RUN_SUBNET_PREFIX pair, checked (ValueError says what is wrong)."""
    try:
        network = ipaddress.IPv4Network(cidr.strip())
    except ValueError as exc:
        raise ValueError(f"RUN_SUBNETS must be an IPv4 network such as 10.240.0.0/16, not {cidr!r} ({exc})") from None
    if not network.network_address.is_private:
        raise ValueError(f"RUN_SUBNETS {cidr} is not a private range: run networks would shadow real addresses")
    if not network.prefixlen <= prefix <= MAX_PREFIX:
        raise ValueError(f"RUN_SUBNET_PREFIX must be between RUN_SUBNETS' own /{network.prefixlen} and /{MAX_PREFIX}")
    found = SubnetRange(str(network), prefix)
    if found.count > MAX_BLOCKS:
        raise ValueError(
            f"RUN_SUBNETS {cidr} in /{prefix} blocks makes {found.count} networks; at most {MAX_BLOCKS}:"
            " use a smaller range or a shorter RUN_SUBNET_PREFIX"
        )
    return found
