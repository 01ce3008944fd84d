"""The run-network range without Docker: its arithmetic (poolcore/subnets.py), the blocks held
in Redis (poolcore/state/subnets.py), which networks of a task take one and how the compose
override pins them (environments/container_spec.py), the routes read at a worker's start and
the packet-filter rules that keep runs apart (environments/networks.py, containment.py)."""

from __future__ import annotations

import threading

import pytest

from environments import container_spec, containment, networks
from poolcore.config import load_settings
from poolcore.state import RESERVED, Store
from poolcore.subnets import SubnetRange, parse

pytestmark = pytest.mark.unit


@pytest.fixture
def store(redis_server) -> Store:
    redis_server.flushall()
    return Store(redis_server)


def test_a_range_splits_into_blocks_by_index():
    blocks = parse("10.240.0.0/16", 26)
    assert blocks.count == 1024
    assert blocks.subnet(0) == "10.240.0.0/26" and blocks.subnet(1) == "10.240.0.64/26"
    assert blocks.subnet(1023) == "10.240.255.192/26"
    with pytest.raises(IndexError):
        blocks.subnet(1024)


def test_overlaps_name_every_block_they_touch():
    blocks = SubnetRange("10.240.0.0/16", 24)
    assert blocks.overlapping(["10.240.3.7/32"]) == {3}
    assert blocks.overlapping(["10.240.4.0/23", "fe80::/64", "not a network"]) == {4, 5}
    assert blocks.overlapping(["10.0.0.0/8"]) == set(range(256))
    assert blocks.overlapping(["10.241.0.0/16", "172.17.0.0/16"]) == set()


@pytest.mark.parametrize(
    "cidr, prefix, says",
    [
        ("10.240.0.0/33", 26, "IPv4 network"),
        ("10.240.0.1/16", 26, "IPv4 network"),  # host bits set
        ("8.8.0.0/16", 26, "not a private range"),
        ("10.240.0.0/16", 14, "between"),
        ("10.240.0.0/16", 30, "between"),
        ("10.0.0.0/8", 24, "at most"),
    ],
)
def test_bad_ranges_are_refused_at_start(cidr, prefix, says):
    with pytest.raises(ValueError, match=says):
        load_settings({"RUN_SUBNETS": cidr, "RUN_SUBNET_PREFIX": str(prefix)})


def test_a_run_takes_its_blocks_once_and_gives_them_back(store):
    assert store.take_subnets("h", "run-a", 2, 4) == [0, 1]
    assert store.take_subnets("h", "run-a", 2, 4) == [0, 1], "a retried start gets what it holds"
    assert store.take_subnets("h", "run-b", 1, 4) == [2]
    assert store.take_subnets("h", "run-c", 2, 4) is None, "all or nothing"
    assert store.subnets_in_use("h") == (3, 0)
    assert store.give_back_subnets("h", "run-a") == 2
    assert store.give_back_subnets("h", "run-a") == 0
    assert store.take_subnets("h", "run-c", 2, 4) == [0, 1]
    assert store.subnet_owners("h") == {"run-b": [2], "run-c": [0, 1]}
    assert store.take_subnets("other-host", "run-x", 4, 4) == [0, 1, 2, 3], "each host has its own range"


def test_concurrent_takers_never_share_a_block(store):
    results = {}

    def take(owner):
        results[owner] = store.take_subnets("h", owner, 3, 64)

    threads = [threading.Thread(target=take, args=(f"run-{i}",)) for i in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [i for blocks in results.values() if blocks for i in blocks]
    assert len(held) == len(set(held)) == 63 and sum(r is None for r in results.values()) == 9


def test_reserved_blocks_are_never_given_and_are_replaced_at_the_next_start(store):
    store.take_subnets("h", "run-a", 1, 8)  # block 0
    assert store.reserve_subnets("h", {0, 1, 2}) == [1, 2], "a run's block stays the run's"
    assert store.take_subnets("h", "run-b", 2, 8) == [3, 4]
    assert store.subnets_in_use("h") == (3, 2)
    assert store.reserve_subnets("h", {7}) == [7]
    assert store.subnet_owners("h")[RESERVED] == [7]
    assert store.take_subnets("h", "run-c", 3, 8) == [1, 2, 5]


def resolved(networks_: dict, services: dict) -> dict:
    return {"name": "proj", "networks": networks_, "services": services}


def test_only_the_runs_own_open_bridge_networks_take_a_block():
    model = resolved(
        {
            "default": {"name": "proj_default", "ipam": {}},
            "pinned": {"name": "proj_pinned", "ipam": {"config": [{"subnet": "10.231.0.0/24"}]}},
            "outside": {"name": "shared", "external": True},
            "unused": {"name": "proj_unused"},
            "macvlan": {"name": "proj_macvlan", "driver": "macvlan"},
        },
        {
            "client": {"networks": {"default": None, "pinned": None, "outside": None, "macvlan": None}},
            "db": {"network_mode": "none"},
        },
    )
    assert container_spec.networks_needing_subnets(model) == ["default"]


def test_the_override_pins_each_block_beside_the_runs_labels():
    model = resolved(
        {"default": {"name": "proj_default", "ipam": {}}, "back": {"name": "proj_back"}},
        {"client": {"image": "x", "networks": {"default": None, "back": None}}},
    )
    subnets = {"default": "10.240.0.0/26", "back": "10.240.0.64/26"}
    override = container_spec.run_override(model, "task", {"l": "1"}, "run", [], load_settings({}), 1, subnets=subnets)
    assert override["networks"]["default"] == {"labels": {"l": "1"}, "ipam": {"config": [{"subnet": "10.240.0.0/26"}]}}
    assert override["networks"]["back"]["ipam"] == {"config": [{"subnet": "10.240.0.64/26"}]}


ROUTE_TABLE = """Iface	Destination	Gateway 	Flags	RefCnt	Use	Metric	Mask		MTU	Window	IRTT
eth0	00000000	010200C0	0003	0	0	0	00000000	0	0	0
eth0	000200C0	00000000	0001	0	0	0	00FFFFFF	0	0	0
docker0	000011AC	00000000	0001	0	0	0	0000FFFF	0	0	0
wg0	0000F00A	00000000	0001	0	0	0	0000FCFF	0	0	0
"""


def test_routes_are_read_from_the_kernels_table_without_the_default_route():
    assert networks.routes(ROUTE_TABLE) == [
        ("eth0", "192.0.2.0/24"),
        ("docker0", "172.17.0.0/16"),
        ("wg0", "10.240.0.0/14"),
    ]


def test_rules_refuse_traffic_between_runs_at_once():
    guard = containment.Guard(
        tag="h", local_ports=(18081,), remote=(), interfaces=("docker0", "br-+"), isolated="br-tpi+"
    )
    rules = [" ".join(rule) for _, rule in containment.rules(guard, "iptables")]
    routed = "-i br-+ -o docker0 -m physdev ! --physdev-is-bridged -p tcp -m comment --comment termpool:h -j REJECT"
    assert any(rule.startswith(routed) for rule in rules), rules
    same_bridge = "-i br-tpi+ -o br-tpi+ -p tcp -m comment --comment termpool:h -j REJECT --reject-with tcp-reset"
    assert same_bridge in rules
    assert not any("-i br-+ -o br-+ -p" in rule for rule in rules), "a compose run's own bridge stays open"
