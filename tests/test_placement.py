"""Placement over many hosts, drain, and host loss in the state store alone (a private Redis,
no Docker): termpool/hosts.py and the Store section of termpool/state.py."""

from __future__ import annotations

import time

import pytest

from termpool import hosts
from termpool.config import QUEUE_KINDS, load_settings
from termpool.state import CapacityError, Store
from tests.conftest import wait_for


@pytest.fixture
def store(redis_server) -> Store:
    redis_server.flushall()
    return Store(redis_server)


@pytest.fixture
def cfg(store):
    env = {"POOL_HOST_ID": "facade-host", "WORKER_MAX_TASKS": "4", "WORKER_MAX_RUNS_PER_TASK": "5"}
    cfg = load_settings({**env, "HOST_SILENCE_SECONDS": "2"})
    # Hosts are judged only once Redis has been up longer than the silence limit.
    assert wait_for(lambda: store.redis_uptime() >= cfg.host_silence, 10)
    return cfg


def beat(store: Store, host: str, kinds=QUEUE_KINDS, at: float | None = None, max_tasks=4, max_runs=5) -> None:
    """The heartbeats of one worker process per queue kind of `host` (as of `at`: older ones)."""
    for kind in kinds:
        capacity = {"max_tasks": max_tasks, "max_runs_per_task": max_runs}
        store.host_beat(host, f"{kind}-x-1@{host}", kind, capacity, now=at)


def place(store, cfg, key="task-a", request_id=""):
    return store.place(key, request_id, key, hosts.placement(cfg, store))


def test_least_loaded_host_gets_the_run(store, cfg):
    beat(store, "a")
    beat(store, "b")
    first = place(store, cfg)
    second = place(store, cfg)
    assert {first.host, second.host} == {"a", "b"}
    placed = [place(store, cfg, key=f"k{i}").host for i in range(6)]
    assert placed.count("a") == placed.count("b") == 3


def test_load_counts_each_hosts_own_capacity(store, cfg):
    beat(store, "small", max_tasks=1, max_runs=2)
    beat(store, "big", max_tasks=8, max_runs=10)
    placed = [place(store, cfg, key=f"k{i}").host for i in range(6)]
    assert placed.count("small") == 1  # a task key of its own fills its one task slot


def test_image_affinity_within_the_slack(store, cfg):
    beat(store, "a")
    beat(store, "b")
    store.mark_image_ready("b", "task-a")
    # 20 runs of capacity: one run is a load of 0.05, within the 0.1 slack; three are not.
    assert [place(store, cfg).host for _ in range(3)] == ["b", "b", "b"]
    assert place(store, cfg).host == "a"


def test_draining_stale_and_incomplete_hosts_take_no_runs(store, cfg):
    beat(store, "draining")
    store.set_draining("draining", True)
    beat(store, "stale", at=time.time() - cfg.host_silence - 5)
    beat(store, "no-exec", kinds=[k for k in QUEUE_KINDS if k != "exec"])
    beat(store, "good")
    assert {place(store, cfg, key=f"k{i}").host for i in range(4)} == {"good"}
    store.set_draining("good", True)
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, key="other")
    assert raised.value.code == "WORKERS_DOWN"


def test_no_host_beating_falls_back_to_the_facades_host(store, cfg):
    assert place(store, cfg).host == "facade-host"


def test_capacity_codes(store, cfg):
    beat(store, "a", max_tasks=1, max_runs=1)
    place(store, cfg, key="one")
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, key="one")
    assert raised.value.code == "RUN_SLOTS_EXHAUSTED"
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, key="two")
    assert raised.value.code == "TASK_SLOTS_EXHAUSTED"


def test_idempotent_allocate_returns_the_same_lease_on_any_host(store, cfg):
    beat(store, "a")
    beat(store, "b")
    leases = {place(store, cfg, key=f"k{i}", request_id=f"r{i}").run_id: f"k{i}" for i in range(4)}
    assert {store.get_run(run)["host"] for run in leases} == {"a", "b"}
    for run_id, key in leases.items():
        again = place(store, cfg, key=key, request_id=f"r{key[1:]}")
        assert again.reused and again.run_id == run_id


def test_lost_host_runs_are_marked_lost_and_free_capacity(store, cfg):
    beat(store, "b")
    lost_run = place(store, cfg, key="k2", request_id="r2").run_id
    store.create_job("job-1", lost_run, "tool_call")
    beat(store, "a")
    beat(store, "b", at=time.time() - 60)  # b's workers last beat a minute ago

    assert hosts.unavailable(store, "b", ("exec",), cfg.host_silence) == "HOST_LOST"
    assert hosts.unavailable(store, "a", ("exec",), cfg.host_silence) == ""
    marked = hosts.sweep(store, cfg.host_silence)
    assert lost_run in marked["b"]
    record = store.get_run(lost_run)
    assert record["state"] == "lost" and record["code"] == "HOST_LOST"
    assert store.get_job("job-1")["code"] == "HOST_LOST"
    assert store.host_status("b")["total_active_runs"] == 0 and store.host_load("b")["lost_runs"] == 1
    assert hosts.overview(store, cfg)["b"]["state"] == "lost"
    # The same request id gets a new run, not the lost one.
    assert place(store, cfg, key="k2", request_id="r2").run_id != lost_run

    # b comes back: its reconcile closes the lost runs first.
    beat(store, "b")
    assert store.settle_lost_runs("b") == [lost_run]
    assert store.get_run(lost_run)["state"] == "closed" and not store.lost_runs("b")


def test_closing_a_lost_run_leaves_its_teardown_to_its_host(store, cfg):
    beat(store, "b")
    run = place(store, cfg, key="k").run_id
    store.mark_host_lost("b", "gone")
    beat(store, "b")  # back, and given a new run of the same task before the lost one is closed
    again = place(store, cfg, key="k").run_id
    assert store.release_on_host(run) == "b" and store.release_on_host(run) is None
    assert store.get_run(run)["state"] == "closing" and store.closing_runs("b") == [run]
    assert store.lost_runs("b") == []
    # the lost run had already left the host's capacity: closing it takes no slot from the new one
    assert store.host_status("b")["tasks"] == {"k": {"active_runs": 1}} and store.live_runs("b") == [again]


def test_a_silent_queue_kind_is_workers_down(store, cfg):
    beat(store, "a", kinds=["eval"], at=time.time() - 30)
    beat(store, "a", kinds=[k for k in QUEUE_KINDS if k != "eval"])
    assert hosts.unavailable(store, "a", ("eval",), cfg.host_silence) == "WORKERS_DOWN"
    assert hosts.unavailable(store, "a", ("exec",), cfg.host_silence) == ""
    assert hosts.unavailable(store, "never-seen", ("exec",), cfg.host_silence) == ""
    assert hosts.overview(store, cfg)["a"]["state"] == "workers_down"


def test_a_clean_stop_deregisters_at_once(store, cfg):
    beat(store, "a")
    for kind in QUEUE_KINDS:
        assert "a" in store.known_hosts()
        store.host_node_stopped("a", f"{kind}-x-1@a", kind)
    assert "a" not in store.known_hosts()
    assert hosts.unavailable(store, "a", ("exec",), cfg.host_silence) == "HOST_LOST"


def test_no_host_is_judged_while_redis_is_younger_than_the_limit(store, cfg):
    beat(store, "a", at=time.time() - 60)
    assert hosts.unavailable(store, "a", ("exec",), cfg.host_silence) == "HOST_LOST"
    long_limit = store.redis_uptime() + 3600  # as if Redis had restarted within the limit
    assert hosts.unavailable(store, "a", ("exec",), long_limit) == ""


def test_a_whole_host_going_silent_kind_by_kind_is_lost_not_workers_down(store):
    """Workers beat up to a heartbeat apart, so a host that stopped crosses the limit one kind
    at a time: while none of its workers beat for two heartbeats, that is the host lost."""
    silence = 7.0
    assert wait_for(lambda: store.redis_uptime() >= silence, 10)
    now = time.time()
    others = [kind for kind in QUEUE_KINDS if kind != "exec"]
    beat(store, "stopped", ["exec"], at=now - 8)
    beat(store, "stopped", others, at=now - 6.5)  # still within the limit, but not recent
    assert hosts.unavailable(store, "stopped", ("exec",), silence) == "HOST_LOST"
    beat(store, "serving", ["exec"], at=now - 8)
    beat(store, "serving", others, at=now - 1)
    assert hosts.unavailable(store, "serving", ("exec",), silence) == "WORKERS_DOWN"
    assert hosts.unavailable(store, "serving", ("eval",), silence) == ""


def test_after_a_redis_restart_last_beats_still_place_runs(store, cfg):
    """While Redis is younger than the silence limit no worker could have beaten: a host's
    last beats count however old, so allocations go on through a Redis restart."""
    beat(store, "old", at=time.time() - 500)
    assert place(store, cfg).host == "facade-host"  # settled Redis: a host silent this long is not live
    young = load_settings({"POOL_HOST_ID": "facade-host", "HOST_SILENCE_SECONDS": str(store.redis_uptime() + 3600)})
    assert place(store, young).host == "old"
