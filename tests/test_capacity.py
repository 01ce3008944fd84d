"""Capacity and lease rules of the state store, against a real Redis."""

from __future__ import annotations

import threading

import pytest

from termpool.state import CapacityError, Store


@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


def test_run_slots_per_task(store):
    runs = [store.allocate("a", "", ["h1"], max_tasks=2, max_runs=2) for _ in range(2)]
    assert len({r.run_id for r in runs}) == 2 and all(r.host == "h1" for r in runs)
    with pytest.raises(CapacityError) as exc:
        store.allocate("a", "", ["h1"], max_tasks=2, max_runs=2)
    assert exc.value.code == "RUN_SLOTS_EXHAUSTED"


def test_task_slots_per_host(store):
    store.allocate("a", "", ["h1"], max_tasks=2, max_runs=2)
    store.allocate("b", "", ["h1"], max_tasks=2, max_runs=2)
    with pytest.raises(CapacityError) as exc:
        store.allocate("c", "", ["h1"], max_tasks=2, max_runs=2)
    assert exc.value.code == "TASK_SLOTS_EXHAUSTED"
    # a second host has room of its own
    assert store.allocate("c", "", ["h1", "h2"], max_tasks=2, max_runs=2).host == "h2"


def test_release_frees_slot_once(store):
    run = store.allocate("a", "", ["h1"], max_tasks=1, max_runs=1)
    assert store.release(run.run_id) is True
    assert store.release(run.run_id) is False
    assert store.host_status("h1")["total_active_runs"] == 0
    assert store.host_status("h1")["pending_closes"] == 1
    assert store.allocate("a", "", ["h1"], max_tasks=1, max_runs=1).run_id != run.run_id


def test_idempotent_allocate(store):
    first = store.allocate("a", "req-1", ["h1"], max_tasks=1, max_runs=1)
    again = store.allocate("a", "req-1", ["h1"], max_tasks=1, max_runs=1)
    assert again.run_id == first.run_id and again.reused and not first.reused
    store.release(first.run_id)
    fresh = store.allocate("a", "req-1", ["h1"], max_tasks=1, max_runs=1)
    assert fresh.run_id != first.run_id and not fresh.reused


def test_concurrent_allocations_never_overcommit(store):
    results, errors = [], []

    def grab():
        try:
            results.append(store.allocate("k", "", ["h1"], max_tasks=1, max_runs=5))
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


def test_idle_runs_and_touch(store):
    run = store.allocate("a", "", ["h1"], max_tasks=1, max_runs=1)
    assert store.idle_runs("h1", idle_ttl=-1) == [run.run_id]
    assert store.idle_runs("h1", idle_ttl=60) == []
    assert store.touch(run.run_id) is True
    store.release(run.run_id)
    assert store.touch(run.run_id) is False
    assert store.idle_runs("h1", idle_ttl=-1) == []


@pytest.mark.parametrize("task_key", ["null", "true", "false", "12"])
def test_task_keys_that_look_like_json_stay_strings(store, task_key):
    run = store.allocate(task_key, "", ["h1"], max_tasks=1, max_runs=1)
    assert store.get_run(run.run_id)["task_key"] == task_key
    store.update_run(run.run_id, score=None, tests={"t": "passed"})
    record = store.get_run(run.run_id)
    assert record["score"] is None and record["tests"] == {"t": "passed"}
    store.update_run(run.run_id, score=0.75)
    assert store.get_run(run.run_id)["score"] == 0.75
