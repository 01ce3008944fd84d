"""The warm pool's sizing rule (poolcore/warm_sizing.py) and its state-store steps (reserve,
trim, forget), against a bare redis-server: no Docker."""

from __future__ import annotations

import json
import time

import pytest

from poolcore import state
from poolcore.config import load_settings
from poolcore.state import Store
from poolcore.warm_sizing import Limits, demand, peak_within, rolling, target

pytestmark = pytest.mark.unit

ROOMY = Limits(max_size=8, free_slots=100, memory_left=8 << 30, idle_bytes=10 << 20)


# ---- sizing ----------------------------------------------------------------------------------
def test_peak_counts_the_busiest_interval():
    assert peak_within([], 1.0) == 0
    assert peak_within([5.0], 1.0) == 1
    assert peak_within([0.0, 0.5, 1.0, 3.0, 3.1], 1.0) == 3
    assert peak_within([3.1, 0.0, 3.0, 1.0, 0.5], 1.0) == 3  # order does not matter
    assert peak_within([0.0, 2.0, 4.0], 1.0) == 1


def test_no_demand_in_the_window_wants_no_spare():
    assert demand([], 100.0, 60.0, 1.0) == 0
    assert demand([10.0, 20.0], 100.0, 60.0, 1.0) == 0  # older than the window
    assert target([10.0], 100.0, 60.0, 1.0, ROOMY) == 0


def test_any_demand_wants_one_spare_and_bursts_want_more():
    assert demand([99.0], 100.0, 60.0, 1.0) == 1
    assert demand([50.0, 70.0, 90.0], 100.0, 60.0, 1.0) == 1  # one reset per refill time
    # 5 resets within one refill time (2 x the 1 s start): 5 spares cover them.
    assert demand([95.0, 95.2, 95.4, 96.0, 96.5, 80.0], 100.0, 60.0, 1.0) == 5
    # The same resets with a start time of 0.1 s fall in different refill times.
    assert demand([95.0, 95.3, 95.6, 96.0], 100.0, 60.0, 0.1) == 1


def test_the_caps_each_bound_the_size():
    burst = [99.0 + i / 100 for i in range(20)]
    assert target(burst, 100.0, 60.0, 1.0, ROOMY) == 8  # WARM_POOL_SIZE
    assert target(burst, 100.0, 60.0, 1.0, Limits(8, 3, 8 << 30, 10 << 20)) == 3  # free run slots
    assert target(burst, 100.0, 60.0, 1.0, Limits(8, 100, 25 << 20, 10 << 20)) == 2  # memory budget
    assert target(burst, 100.0, 60.0, 1.0, Limits(8, -2, 8 << 30, 10 << 20)) == 0  # host overfull
    assert target(burst, 100.0, 60.0, 1.0, Limits(8, 100, -5, 10 << 20)) == 0  # budget spent elsewhere
    assert target(burst, 100.0, 60.0, 1.0, Limits(0, 100, 8 << 30, 10 << 20)) == 0  # pool off


def test_rolling_mean_follows_measurements():
    assert rolling(None, 2.0) == 2.0
    assert rolling(2.0, 1.0) == pytest.approx(1.7)


def test_settings_defaults_and_the_idle_ttl_cap():
    cfg = load_settings({})
    assert (cfg.warm_pool_size, cfg.warm_pool_memory, cfg.warm_idle_ttl, cfg.warm_demand_window) == (
        8,
        2 << 30,
        180.0,
        60.0,
    )
    assert load_settings({"WARM_IDLE_TTL": "900", "WORKER_RUN_IDLE_TTL": "120"}).warm_idle_ttl == 120.0
    assert load_settings({"WARM_POOL_MEMORY": "512m"}).warm_pool_memory == 512 << 20
    with pytest.raises(ValueError, match="WARM_POOL_MEMORY"):
        load_settings({"WARM_POOL_MEMORY": "lots"})
    with pytest.raises(ValueError, match="WARM_POOL_SIZE"):
        load_settings({"WARM_POOL_SIZE": "-1"})


# ---- the state store's steps -------------------------------------------------------------------
@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


def test_reserve_fills_up_to_target_a_few_at_a_time(store):
    first = store.warm_reserve("h", "t", target=5, at_once=2, ttl=60)
    assert len(first) == 2 and store.warm_starting("h", "t") == 2
    assert all(store.warm_known(w) for w in first)  # a sweep spares them while they start
    assert store.warm_reserve("h", "t", target=5, at_once=2, ttl=60) == []  # two start already
    store.warm_push("h", "t", {"warm_id": first[0]})
    store.warm_push("h", "t", {"warm_id": first[1]})
    assert store.warm_starting("h", "t") == 0 and store.warm_count("h", "t") == 2
    assert len(store.warm_reserve("h", "t", target=3, at_once=2, ttl=60)) == 1  # 2 pooled + 1 = 3
    assert store.warm_reserve("h", "t", target=1, at_once=2, ttl=60) == []  # above target already


def test_a_start_that_lapses_or_fails_frees_its_place(store):
    (lapsing,) = store.warm_reserve("h", "t", target=1, at_once=1, ttl=1)
    assert store.warm_starting("h", "t") == 1
    time.sleep(1.1)
    assert store.warm_starting("h", "t") == 0
    (failing,) = store.warm_reserve("h", "t", target=1, at_once=1, ttl=60)
    store.warm_unreserve("h", "t", failing)
    assert store.warm_starting("h", "t") == 0 and not store.warm_known(failing)


def test_trim_takes_surplus_and_idle_spares_oldest_first(store):
    for i in range(4):
        store.warm_push("h", "t", {"warm_id": f"warm-{i}", "pushed_at": 100.0 + i})
    assert [e["warm_id"] for e in store.warm_trim("h", "t", keep=3, cutoff=0)] == ["warm-0"]
    assert [e["warm_id"] for e in store.warm_trim("h", "t", keep=3, cutoff=102.5)] == ["warm-1", "warm-2"]
    assert not store.warm_known("warm-1")  # trimmed: a sweep may remove it too
    assert store.warm_known("warm-3")
    assert store.warm_trim("h", "t", keep=0, cutoff=0)[0]["warm_id"] == "warm-3"
    assert store.warm_count("h", "t") == 0


def test_claimed_spares_are_never_trimmed(store):
    store.warm_push("h", "t", {"warm_id": "warm-a", "pushed_at": 1.0})
    assert store.warm_claim("h", "t", "run-1")["warm_id"] == "warm-a"
    assert store.warm_trim("h", "t", keep=0, cutoff=time.time()) == []


def test_a_push_or_claim_sent_again_changes_nothing(store):
    """Redis's client sends a command again when a partition lost its reply, which may have
    run: a spare is pooled once (else two runs would share its container), and a run's second
    claim gets its first spare."""
    store.warm_reserve("h", "t", target=2, at_once=2, ttl=60)
    assert store.warm_push("h", "t", {"warm_id": "warm-a"}) is True
    assert store.warm_push("h", "t", {"warm_id": "warm-a"}) is False
    store.warm_push("h", "t", {"warm_id": "warm-b"})
    assert store.warm_count("h", "t") == 2
    first = store.warm_claim("h", "t", "run-1")
    assert store.warm_claim("h", "t", "run-1") == first and store.warm_count("h", "t") == 1
    assert store.warm_claim("h", "t", "run-2")["warm_id"] != first["warm_id"]
    assert store.warm_push("h", "t", {"warm_id": first["warm_id"]}) is False  # claimed: never pooled again


def test_a_spare_found_dead_is_not_claimed_again(store):
    """The reset removes a claimed spare that died while pooled (warm_forget) and claims again:
    it gets the next one, not the dead one (else it would loop on it)."""
    for warm_id in ("warm-a", "warm-b"):
        store.warm_push("h", "t", {"warm_id": warm_id})
    first = store.warm_claim("h", "t", "run-1")
    store.warm_forget(first["warm_id"])
    second = store.warm_claim("h", "t", "run-1")
    assert second is not None and second["warm_id"] != first["warm_id"]
    assert store.warm_claim("h", "t", "run-1") == second
    store.warm_forget(second["warm_id"])
    assert store.warm_claim("h", "t", "run-1") is None


def test_demand_is_noted_per_reset_and_ages_out(store):
    store.warm_note_reset("h", "t", "run-1", "task-t", claimed=False, window=60)
    store.warm_note_reset("h", "t", "run-1", "task-t", claimed=True, window=60)  # a second reset counts too
    assert len(store.warm_resets("h", "t", 60)) == 2
    assert store.warm_resets("h", "t", 0.0) == []
    assert store.warm_tasks("h") == {"t"} and store.warm_facts("h", "t")["task_name"] == "task-t"
    assert store.warm_counters("h") == {"claimed": 1.0, "missed": 1.0}
    store.warm_set_facts("h", "t", start_s=0.5)
    assert not store.warm_forget_task("h", "t", 60)  # demand still recent
    store.warm_push("h", "t", {"warm_id": "warm-x"})
    assert not store.warm_forget_task("h", "t", 0.0)  # the window passed, but a spare is pooled
    assert store.warm_facts("h", "t")["start_s"] == 0.5  # kept while the task is looked after
    store.warm_trim("h", "t", 0, 0)
    assert store.warm_forget_task("h", "t", 0.0) and store.warm_tasks("h") == set()
    assert not store._r.exists(state.warm_demand_key("h", "t"))
    assert store.warm_facts("h", "t") == {}  # a forgotten task keeps no hash (one per upload would pile up)


def test_pools_list_every_task_of_the_host(store):
    store.warm_push("h", "a", {"warm_id": "warm-1"})
    store.warm_push("h", "b", {"warm_id": "warm-2"})
    store.warm_push("other", "a", {"warm_id": "warm-3"})
    pools = store.warm_pools("h")
    assert {k: [e["warm_id"] for e in v] for k, v in pools.items()} == {"a": ["warm-1"], "b": ["warm-2"]}
    assert json.loads(store._r.lindex(state.warm_key("h", "a"), 0))["pushed_at"] > 0


def test_starts_on_record_can_be_taken_back(store):
    ids = store.warm_reserve("h", "t", target=3, at_once=3, ttl=300)
    assert sorted(store.warm_take_starting("h", "t")) == sorted(ids)
    assert store.warm_starting("h", "t") == 0 and not any(store.warm_known(w) for w in ids)
    assert store.warm_take_starting("h", "t") == []
