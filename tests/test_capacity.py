"""Capacity and lease rules of the state store, against a real Redis."""

from __future__ import annotations

import threading
import time

import pytest

from poolcore import state
from poolcore.state import IDEMPOTENCY_TTL, CapacityError, Placement, Store, request_key
from tests.conftest import wait_for

pytestmark = pytest.mark.unit


def allocate(store: Store, task_key: str, request_id: str, host: str = "h1", *, max_tasks: int, max_runs: int):
    """Store.place with one host (no worker beats: the fallback host, with these limits)."""
    rule = Placement(
        preferred=[], excluded=[], default_tasks=max_tasks, default_runs=max_runs, slack=0.1, fallback=host
    )
    return store.place(task_key, request_id, task_key, rule)


@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


def test_run_slots_per_task(store):
    runs = [allocate(store, "a", "", max_tasks=2, max_runs=2) for _ in range(2)]
    assert len({r.run_id for r in runs}) == 2 and all(r.host == "h1" for r in runs)
    with pytest.raises(CapacityError) as exc:
        allocate(store, "a", "", max_tasks=2, max_runs=2)
    assert exc.value.code == "RUN_SLOTS_EXHAUSTED"


def test_task_slots_per_host(store):
    allocate(store, "a", "", max_tasks=2, max_runs=2)
    allocate(store, "b", "", max_tasks=2, max_runs=2)
    with pytest.raises(CapacityError) as exc:
        allocate(store, "c", "", max_tasks=2, max_runs=2)
    assert exc.value.code == "TASK_SLOTS_EXHAUSTED"
    # another host has room of its own
    assert allocate(store, "c", "", "h2", max_tasks=2, max_runs=2).host == "h2"


def test_release_frees_slot_once(store):
    run = allocate(store, "a", "", max_tasks=1, max_runs=1)
    assert store.release(run.run_id) is True
    assert store.release(run.run_id) is False
    assert store.host_status("h1")["total_active_runs"] == 0
    assert store.host_status("h1")["pending_closes"] == 1
    assert allocate(store, "a", "", max_tasks=1, max_runs=1).run_id != run.run_id


def test_idempotent_allocate(store):
    first = allocate(store, "a", "req-1", max_tasks=1, max_runs=1)
    again = allocate(store, "a", "req-1", max_tasks=1, max_runs=1)
    assert again.run_id == first.run_id and again.reused and not first.reused
    store.release(first.run_id)
    fresh = allocate(store, "a", "req-1", max_tasks=1, max_runs=1)
    assert fresh.run_id != first.run_id and not fresh.reused


def test_idempotency_lasts_the_ttl_then_a_request_id_is_new(store, redis_server):
    first = allocate(store, "a", "req-1", max_tasks=2, max_runs=2)
    key = request_key("a", "req-1")
    assert 0 < redis_server.ttl(key) <= IDEMPOTENCY_TTL
    assert allocate(store, "a", "req-1", max_tasks=2, max_runs=2).run_id == first.run_id
    redis_server.pexpire(key, 1)  # the TTL runs out
    assert wait_for(lambda: not redis_server.exists(key), 5, 0.01)
    later = allocate(store, "a", "req-1", max_tasks=2, max_runs=2)
    assert later.run_id != first.run_id and not later.reused


def test_a_request_id_is_scoped_to_its_task_key(store):
    a = allocate(store, "a", "req-1", max_tasks=2, max_runs=1)
    b = allocate(store, "b", "req-1", max_tasks=2, max_runs=1)
    assert a.run_id != b.run_id and not b.reused


def test_a_reused_allocation_takes_no_slot(store):
    first = allocate(store, "a", "req-1", max_tasks=1, max_runs=1)
    for _ in range(3):
        assert allocate(store, "a", "req-1", max_tasks=1, max_runs=1).reused
    assert store.host_status("h1")["total_active_runs"] == 1
    with pytest.raises(CapacityError) as exc:
        allocate(store, "a", "req-2", max_tasks=1, max_runs=1)
    assert exc.value.code == "RUN_SLOTS_EXHAUSTED"
    assert store.release(first.run_id) is True


def test_release_frees_the_task_slot_for_another_task(store):
    run = allocate(store, "a", "", max_tasks=1, max_runs=1)
    with pytest.raises(CapacityError) as exc:
        allocate(store, "b", "", max_tasks=1, max_runs=1)
    assert exc.value.code == "TASK_SLOTS_EXHAUSTED"
    assert store.release(run.run_id) is True
    assert store.host_status("h1")["tasks"] == {}
    assert allocate(store, "b", "", max_tasks=1, max_runs=1).host == "h1"


def test_release_of_an_unknown_run_or_in_another_state(store):
    assert store.release("run-0000000000000000") is False
    run = allocate(store, "a", "", max_tasks=1, max_runs=1)
    assert store.release(run.run_id, only_state="running") is False  # it is still "allocated"
    assert store.host_status("h1")["total_active_runs"] == 1
    assert store.release(run.run_id, reason="never_reset", only_state="allocated") is True
    assert store.get_run(run.run_id)["closing_reason"] == "never_reset"
    assert store.release(run.run_id) is False
    assert store.host_status("h1")["total_active_runs"] == 0


def test_concurrent_allocations_never_overcommit(store):
    results, errors = [], []

    def grab():
        try:
            results.append(allocate(store, "k", "", max_tasks=1, max_runs=5))
        except CapacityError as exc:
            errors.append(exc.code)

    threads = [threading.Thread(target=grab) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 5 and len(errors) == 35
    assert set(errors) == {"RUN_SLOTS_EXHAUSTED"}
    assert store.host_status("h1")["tasks"] == {"k": {"active_runs": 5}}


def test_idle_runs_and_touch(store, redis_server):
    run = allocate(store, "a", "", max_tasks=1, max_runs=1)
    assert store.idle_runs("h1", idle_ttl=-1) == [run.run_id]
    assert store.idle_runs("h1", idle_ttl=60) == []
    # A run used since its score was set is not idle, and its score catches up for next time.
    long_ago = time.time() - 100
    redis_server.zadd(state.host_live_key("h1"), {run.run_id: long_ago})
    store.update_run(run.run_id, last_used_at=long_ago)
    assert store.idle_runs("h1", idle_ttl=50) == [run.run_id]  # unused for 100 s
    assert store.touch(run.run_id) is True
    assert store.idle_runs("h1", idle_ttl=50) == []
    assert redis_server.zscore(state.host_live_key("h1"), run.run_id) > time.time() - 5
    assert store.touch(run.run_id) is True
    store.release(run.run_id)
    assert store.touch(run.run_id) is False
    assert store.idle_runs("h1", idle_ttl=-1) == []


@pytest.mark.parametrize("task_key", ["null", "true", "false", "12"])
def test_task_keys_that_look_like_json_stay_strings(store, task_key):
    run = allocate(store, task_key, "", max_tasks=1, max_runs=1)
    assert store.get_run(run.run_id)["task_key"] == task_key
    store.update_run(run.run_id, score=None, tests={"t": "passed"})
    record = store.get_run(run.run_id)
    assert record["score"] is None and record["tests"] == {"t": "passed"}
    store.update_run(run.run_id, score=0.75)
    assert store.get_run(run.run_id)["score"] == 0.75
