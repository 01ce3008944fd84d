"""Placement over many hosts, drain, and host loss in the state store alone (a private Redis,
no Docker): poolcore/hosts.py and poolcore/state/hosts.py."""

from __future__ import annotations

import time

import pytest

from poolcore import hosts, liveness
from poolcore.config import QUEUE_KINDS, load_settings
from poolcore.state import CapacityError, Store


@pytest.fixture
def store(redis_server) -> Store:
    redis_server.flushall()
    return Store(redis_server)


@pytest.fixture
def cfg(store):
    env = {"POOL_HOST_ID": "facade-host", "WORKER_MAX_TASKS": "4", "WORKER_MAX_RUNS_PER_TASK": "5"}
    return load_settings({**env, "HOST_SILENCE_SECONDS": "2"})


@pytest.fixture
def watch(store, cfg):
    """The facade's judgement, polled by hand (no thread): see() makes it watch beats advance."""
    return hosts.make_watch(cfg, store)


def beat(store: Store, host: str, kinds=QUEUE_KINDS, at: float | None = None, max_tasks=4, max_runs=5) -> None:
    """The heartbeats of one worker process per queue kind of `host` (as of `at`: older ones)."""
    for kind in kinds:
        capacity = {"max_tasks": max_tasks, "max_runs_per_task": max_runs}
        store.host_beat(host, f"{kind}-x-1@{host}", kind, capacity, now=at)


def see(store: Store, watch, host: str, kinds=QUEUE_KINDS, **capacity) -> None:
    """Beat twice with the watch reading in between: it has seen these workers alive."""
    beat(store, host, kinds, **capacity)
    watch.poll()
    time.sleep(0.01)
    beat(store, host, kinds, **capacity)
    watch.poll()


def place(store, cfg, watch, key="task-a", request_id=""):
    watch.poll()
    return store.place(key, request_id, key, hosts.placement(cfg, watch))


def silent_for(watch, seconds: float) -> None:
    """Let `seconds` pass with the watch reading (and so in contact) all along."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        watch.poll()
        time.sleep(0.1)
    watch.poll()


def test_least_loaded_host_gets_the_run(store, cfg, watch):
    see(store, watch, "a")
    see(store, watch, "b")
    first = place(store, cfg, watch)
    second = place(store, cfg, watch)
    assert {first.host, second.host} == {"a", "b"}
    placed = [place(store, cfg, watch, key=f"k{i}").host for i in range(6)]
    assert placed.count("a") == placed.count("b") == 3


def test_load_counts_each_hosts_own_capacity(store, cfg, watch):
    see(store, watch, "small", max_tasks=1, max_runs=2)
    see(store, watch, "big", max_tasks=8, max_runs=10)
    placed = [place(store, cfg, watch, key=f"k{i}").host for i in range(6)]
    assert placed.count("small") == 1  # a task key of its own fills its one task slot


def test_image_affinity_within_the_slack(store, cfg, watch):
    see(store, watch, "a")
    see(store, watch, "b")
    store.mark_image_ready("b", "task-a")
    # 20 runs of capacity: one run is a load of 0.05, within the 0.1 slack; three are not.
    assert [place(store, cfg, watch).host for _ in range(3)] == ["b", "b", "b"]
    assert place(store, cfg, watch).host == "a"


def test_serving_hosts_are_preferred_draining_and_lost_ones_take_no_runs(store, cfg, watch):
    see(store, watch, "draining")
    store.set_draining("draining", True)
    beat(store, "stale", at=time.time() - 500)  # a previous incarnation's records: not judged
    see(store, watch, "no-exec", kinds=[k for k in QUEUE_KINDS if k != "exec"])
    see(store, watch, "good")
    assert {place(store, cfg, watch, key=f"k{i}").host for i in range(4)} == {"good"}
    # With no host serving every kind, any known host not draining or lost takes runs.
    store.set_draining("good", True)
    assert {place(store, cfg, watch, key=f"o{i}").host for i in range(4)} == {"stale", "no-exec"}
    # Hosts seen alive that fall silent are lost: never a candidate.
    silent_for(watch, cfg.host_silence + 0.5)
    assert watch.judgement("no-exec").lost and not watch.judgement("stale").lost
    assert {place(store, cfg, watch, key=f"p{i}").host for i in range(2)} == {"stale"}
    store.set_draining("stale", True)
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch, key="other")
    assert raised.value.code == "WORKERS_DOWN"


def test_no_host_known_falls_back_to_the_facades_host(store, cfg, watch):
    assert place(store, cfg, watch).host == "facade-host"


def test_a_starting_host_takes_runs_before_its_workers_beat_twice(store, cfg, watch):
    """A fresh start: the first beats are on record, no watch has seen them advance yet."""
    beat(store, "fresh", kinds=["build"])
    assert place(store, cfg, watch).host == "fresh"
    assert watch.judgement("fresh").state(QUEUE_KINDS) == "starting"
    assert hosts.unavailable(watch, "fresh", ("exec",)) == ""


def test_capacity_codes(store, cfg, watch):
    see(store, watch, "a", max_tasks=1, max_runs=1)
    place(store, cfg, watch, key="one")
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch, key="one")
    assert raised.value.code == "RUN_SLOTS_EXHAUSTED"
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch, key="two")
    assert raised.value.code == "TASK_SLOTS_EXHAUSTED"


def test_idempotent_allocate_returns_the_same_lease_on_any_host(store, cfg, watch):
    see(store, watch, "a")
    see(store, watch, "b")
    leases = {place(store, cfg, watch, key=f"k{i}", request_id=f"r{i}").run_id: f"k{i}" for i in range(4)}
    assert {store.get_run(run)["host"] for run in leases} == {"a", "b"}
    for run_id, key in leases.items():
        again = place(store, cfg, watch, key=key, request_id=f"r{key[1:]}")
        assert again.reused and again.run_id == run_id


def test_lost_host_runs_are_marked_lost_and_free_capacity(store, cfg, watch):
    see(store, watch, "b")
    lost_run = place(store, cfg, watch, key="k2", request_id="r2").run_id
    store.create_job("job-1", lost_run, "tool_call")
    see(store, watch, "a")
    deadline = time.monotonic() + cfg.host_silence + 0.5
    while time.monotonic() < deadline:  # a keeps beating, b's workers are gone
        beat(store, "a")
        silent_for(watch, 0.3)

    assert hosts.unavailable(watch, "b", ("exec",)) == "HOST_LOST"
    assert hosts.unavailable(watch, "a", ("exec",)) == ""
    marked = hosts.sweep(store, watch)
    assert lost_run in marked["b"]
    record = store.get_run(lost_run)
    assert record["state"] == "lost" and record["code"] == "HOST_LOST"
    assert store.get_job("job-1")["code"] == "HOST_LOST"
    assert store.host_status("b")["total_active_runs"] == 0 and store.host_load("b")["lost_runs"] == 1
    assert hosts.overview(store, cfg, watch)["b"]["state"] == "lost"
    # The same request id gets a new run, not the lost one.
    assert place(store, cfg, watch, key="k2", request_id="r2").run_id != lost_run

    # b comes back: its reconcile closes the lost runs first.
    see(store, watch, "b")
    assert not watch.judgement("b").lost
    assert store.settle_lost_runs("b") == [lost_run]
    assert store.get_run(lost_run)["state"] == "closed" and not store.lost_runs("b")


@pytest.fixture
def slow_watch(store, cfg):
    """Another facade process's watch that still counts a silent host alive (it read the host's
    last beat later; here: a longer silence limit, which is the same for the test)."""
    return hosts.make_watch(load_settings({"HOST_SILENCE_SECONDS": "30"}), store)


def lose_b(store, cfg, watch, slow_watch) -> None:
    """a and b serve, b falls silent: `watch` judges b lost, `slow_watch` does not yet."""
    for judge in (watch, slow_watch):
        see(store, judge, "a")
        see(store, judge, "b")
    store.mark_image_ready("b", "task-a")  # b would win every run here while it counts as alive
    deadline = time.monotonic() + cfg.host_silence + 0.5
    while time.monotonic() < deadline:  # a keeps beating, b's workers are gone
        beat(store, "a")
        slow_watch.poll()
        silent_for(watch, 0.3)
    assert watch.judgement("b").lost and not slow_watch.judgement("b").lost


def test_a_host_another_process_judged_lost_takes_no_runs_until_it_beats(store, cfg, watch, slow_watch):
    """Each facade process judges from its own watch: one that has not yet counted b silent
    does not place on b once another marked b lost; b is placeable again at its next beat."""
    lose_b(store, cfg, watch, slow_watch)
    assert hosts.check(store, watch, "b", ("exec",))[0] == "HOST_LOST"  # marks b lost
    assert [place(store, cfg, slow_watch).host for _ in range(3)] == ["a"] * 3
    assert hosts.overview(store, cfg, slow_watch)["b"]["state"] == "lost", "its /status says so too"
    beat(store, "b")  # back: the mark no longer holds, before any watch has read the beat
    assert store.place("task-a", "", "task-a", hosts.placement(cfg, slow_watch)).host == "b"
    assert place(store, cfg, watch).host == "b"
    slow_watch.poll()  # it reads the new beat: b is no longer shown lost
    assert hosts.overview(store, cfg, slow_watch)["b"]["state"] != "lost"


def test_a_mark_made_after_the_host_beat_again_excludes_nothing(store, cfg, watch, slow_watch):
    """A judge marks b lost by what it read last: a beat since then already lifts its mark."""
    lose_b(store, cfg, watch, slow_watch)
    beat(store, "b")  # b is back, and `watch` has not read it yet
    hosts.sweep(store, watch)
    assert place(store, cfg, slow_watch).host == "b"


def test_closing_a_lost_run_leaves_its_teardown_to_its_host(store, cfg, watch):
    see(store, watch, "b")
    run = place(store, cfg, watch, key="k").run_id
    store.mark_host_lost("b", "gone", store.known_hosts()["b"])
    see(store, watch, "b")  # back, and given a new run of the same task before the lost one is closed
    again = place(store, cfg, watch, key="k").run_id
    assert store.release_on_host(run) == "b" and store.release_on_host(run) is None
    assert store.get_run(run)["state"] == "closing" and store.closing_runs("b") == [run]
    assert store.lost_runs("b") == []
    # the lost run had already left the host's capacity: closing it takes no slot from the new one
    assert store.host_status("b")["tasks"] == {"k": {"active_runs": 1}} and store.live_runs("b") == [again]


def test_a_silent_queue_kind_is_workers_down(store, cfg, watch):
    see(store, watch, "a")
    others = [k for k in QUEUE_KINDS if k != "eval"]
    deadline = time.monotonic() + cfg.host_silence + 0.5
    while time.monotonic() < deadline:  # every kind but eval keeps beating
        beat(store, "a", kinds=others)
        silent_for(watch, 0.3)
    assert hosts.unavailable(watch, "a", ("eval",)) == "WORKERS_DOWN"
    assert hosts.unavailable(watch, "a", ("exec",)) == ""
    assert hosts.unavailable(watch, "never-seen", ("exec",)) == ""
    assert hosts.overview(store, cfg, watch)["a"]["state"] == "workers_down"
    # Its other kinds keep serving: the host still takes runs when none serves every kind.
    assert place(store, cfg, watch).host == "a"


def test_a_clean_stop_leaves_the_list_and_is_judged_after_the_limit(store, cfg, watch):
    see(store, watch, "a")
    for kind in QUEUE_KINDS:
        assert "a" in store.known_hosts()
        store.host_node_stopped("a", f"{kind}-x-1@a", kind)
    assert "a" not in store.known_hosts()
    watch.poll()
    assert hosts.unavailable(watch, "a", ("exec",)) == ""  # a restart beats again well within the limit
    silent_for(watch, cfg.host_silence + 0.5)
    assert hosts.unavailable(watch, "a", ("exec",)) == "HOST_LOST"


def test_a_previous_incarnations_records_never_make_the_host_look_lost(store, cfg, watch):
    """kill -9 of the whole stack, then a start with Redis's data kept: the old beats stand
    still. The new watch never saw them advance, so nothing is judged until the new workers beat."""
    beat(store, "a", at=time.time() - 60)
    silent_for(watch, cfg.host_silence + 0.5)
    assert hosts.unavailable(watch, "a", ("exec",)) == ""
    assert hosts.sweep(store, watch) == {}
    assert place(store, cfg, watch).host == "a"
    assert hosts.readiness(watch) == (False, f"host a is starting, waiting for {', '.join(sorted(QUEUE_KINDS))}")
    see(store, watch, "a")
    assert hosts.readiness(watch) == (True, "host a serves every queue kind")


def test_readiness_reads_the_beats_again_before_saying_no(store, cfg, watch):
    """Each facade process has its own watch: one that has not read the beat another process
    just saw advance reads it before answering 503."""
    beat(store, "a")
    watch.poll()
    time.sleep(0.01)
    beat(store, "a")  # advanced since this watch's last read
    assert hosts.readiness(watch) == (True, "host a serves every queue kind")


def test_time_without_redis_is_nobodys_silence(store, cfg):
    """A Redis outage or partition: the watch could not read, the workers could not beat.
    Once Redis answers, every worker gets the whole limit to beat again."""
    reachable = True

    def read(also):
        if not reachable:
            raise ConnectionError("partitioned")
        return liveness.Snapshot(*store.beats_snapshot(also))

    watch = liveness.Watch(read, silence=cfg.host_silence, recent=2 * hosts.HEARTBEAT_SECONDS)
    see(store, watch, "a")
    reachable = False
    time.sleep(cfg.host_silence + 0.5)
    watch.poll()
    assert watch.judgement("a") == liveness.HostJudgement()  # no contact: nothing judged
    reachable = True
    watch.poll()  # back: the beats are old, but contact only just resumed
    assert hosts.unavailable(watch, "a", ("exec",)) == ""
    silent_for(watch, cfg.host_silence + 0.5)  # a whole limit of contact without a beat
    assert hosts.unavailable(watch, "a", ("exec",)) == "HOST_LOST"


def test_a_whole_host_going_silent_kind_by_kind_is_lost_not_workers_down():
    """Workers beat up to a heartbeat apart, so a host that stopped crosses the limit one kind
    at a time: while none of its workers beat within two heartbeats, that is the host lost."""
    others = [kind for kind in QUEUE_KINDS if kind != "exec"]
    seen = {f"{k}@h": liveness.Seen(k, 1.0, changed_at=0.0, alive=True) for k in QUEUE_KINDS}
    stopped = {**seen, **{f"{k}@h": liveness.Seen(k, 1.0, changed_at=1.5, alive=True) for k in others}}
    judged = liveness.judge(stopped, now=8.0, silence=7.0, contact_since=0.0, recent=6.0)
    assert judged.down == {"exec"} and judged.lost
    serving = {**seen, **{f"{k}@h": liveness.Seen(k, 2.0, changed_at=7.0, alive=True) for k in others}}
    judged = liveness.judge(serving, now=8.0, silence=7.0, contact_since=0.0, recent=6.0)
    assert judged.down == {"exec"} and not judged.lost and judged.state(QUEUE_KINDS) == "workers_down"


def test_a_restarted_worker_is_its_kind_starting_not_down(store, cfg, watch):
    """A worker restarted by its supervisor beats under a new node name (its pid is in it): once
    the old one is silent past the limit, the new one's first beat keeps the kind starting until
    its second makes it serving; a new node that never beats again is judged after the limit."""
    see(store, watch, "a")
    silent_for(watch, cfg.host_silence + 0.5)
    assert watch.judgement("a").lost
    store.host_beat("a", "eval-x-2@a", "eval", {"max_tasks": 4, "max_runs_per_task": 5})
    watch.poll()
    judged = watch.judgement("a")
    assert not judged.lost and "eval" not in judged.down and hosts.unavailable(watch, "a", ("eval",)) == ""
    assert hosts.unavailable(watch, "a", ("exec",)) == "WORKERS_DOWN"
    silent_for(watch, cfg.host_silence + 0.5)
    assert watch.judgement("a").lost
