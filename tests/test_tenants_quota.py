"""Tenant quotas in the state store's scripts alone (a private Redis, no Docker): max_runs and
reserved_runs decided where a slot is taken (_PLACE, FORK_PLACE_LUA), the tenant's count left by
every script that frees a slot (release, a lost run, a lost host). docs/tenants.md."""

from __future__ import annotations

import dataclasses

import pytest

from poolcore import hosts
from poolcore.config import load_settings
from poolcore.state import CapacityError, ForkRefused, Store, keys
from tests.test_placement import see

pytestmark = pytest.mark.unit

RESERVED = {"a": 2}  # tenant a holds 2 slots; the host holds 2 task keys x 3 runs = 6


@pytest.fixture
def pool(redis_server):
    """A private Redis, emptied, with one host "h" (2 task keys x 3 runs) seen alive: (store, cfg, watch)."""
    redis_server.flushall()
    store = Store(redis_server)
    cfg = load_settings({"POOL_HOST_ID": "h", "WORKER_MAX_TASKS": "2", "WORKER_MAX_RUNS_PER_TASK": "3"})
    watch = hosts.make_watch(cfg, store)
    see(store, watch, "h", max_tasks=2, max_runs=3)
    return store, cfg, watch


def place(store, cfg, watch, tenant="", max_runs=None, key="k1", request_id=""):
    rule = dataclasses.replace(
        hosts.placement(cfg, watch), tenant=tenant, max_runs=max_runs, reservations=dict(RESERVED)
    )
    return store.place(key, request_id, key, rule)


def live(store, tenant: str) -> int:
    return len(store.tenant_live_runs(tenant))


def test_max_runs_refuses_before_taking(pool):
    store, cfg, watch = pool
    runs = [place(store, cfg, watch, "a", max_runs=2).run_id for _ in range(2)]
    with pytest.raises(CapacityError) as refused:
        place(store, cfg, watch, "a", max_runs=2)
    assert (refused.value.code, refused.value.reason) == ("TENANT_QUOTA_EXCEEDED", "max_runs")
    assert live(store, "a") == 2 and store.host_status("h")["total_active_runs"] == 2
    assert all(store.get_run(run)["tenant"] == "a" for run in runs)
    store.release(runs[0])  # its slot, and its tenant's count, are free at once
    assert live(store, "a") == 1
    place(store, cfg, watch, "a", max_runs=2)


def test_others_take_only_what_unused_reservations_leave(pool):
    store, cfg, watch = pool
    taken = [place(store, cfg, watch, "b", key=f"k{i % 2}").run_id for i in range(4)]  # 6 - a's 2
    for tenant in ("b", ""):  # another tenant, and the operator
        with pytest.raises(CapacityError) as refused:
            place(store, cfg, watch, tenant, key="k1")
        assert (refused.value.code, refused.value.reason) == ("TENANT_QUOTA_EXCEEDED", "reserved")
    place(store, cfg, watch, "a", key="k0")  # below its reservation: not held back
    place(store, cfg, watch, "a", key="k1")
    assert live(store, "b") == 4 and live(store, "a") == 2
    store.release(taken[0])
    place(store, cfg, watch, "b", key="k0")  # a holds its 2: the freed slot is anyone's


def test_a_lost_run_or_host_leaves_its_tenants_count(pool):
    store, cfg, watch = pool
    first, second = (place(store, cfg, watch, "a").run_id for _ in range(2))
    assert store.mark_run_lost(first, "gone", ("allocated",), code="CONTAINER_LOST")
    assert store.tenant_live_runs("a") == [second]
    store.mark_host_lost("h", "silent", 0)
    assert live(store, "a") == 0
    store.release(first)  # a lost run's close frees nothing twice
    assert live(store, "a") == 0


def test_request_ids_are_each_tenants_own(pool):
    store, cfg, watch = pool
    mine = place(store, cfg, watch, "a", request_id="r1")
    again = place(store, cfg, watch, "a", request_id="r1")
    theirs = place(store, cfg, watch, "b", request_id="r1")
    assert again.reused and again.run_id == mine.run_id
    assert not theirs.reused and theirs.run_id != mine.run_id
    assert store.run_owner(theirs.run_id) == "b" and store.run_owner("run-nothing") is None


def test_fork_children_are_the_sources_tenants_and_count(pool):
    store, cfg, watch = pool
    source = place(store, cfg, watch, "a").run_id
    store.update_run(source, state="ready")
    with pytest.raises(ForkRefused) as refused:
        store.place_fork(source, ["run-c1", "run-c2"], "job-f", 3, 3, tenant_quota=2)
    assert refused.value.code == "TENANT_QUOTA_EXCEEDED" and live(store, "a") == 1
    store.place_fork(source, ["run-c1"], "job-f", 3, 3, tenant_quota=2)
    assert store.run_owner("run-c1") == "a" and sorted(store.tenant_live_runs("a")) == sorted([source, "run-c1"])


def test_no_tenants_is_todays_placement(pool, redis_server):
    store, cfg, watch = pool
    rule = hosts.placement(cfg, watch)
    assert (rule.tenant, rule.max_runs, rule.reservations) == ("", None, {})
    runs = [store.place(f"k{i % 2}", "", "x", rule).run_id for i in range(6)]
    assert "tenant" not in store.get_run(runs[0]) and not redis_server.keys(keys.tenant_live_key("*"))
