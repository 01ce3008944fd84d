"""The state store's keys, Lua scripts, locks and queue depths, against a bare redis-server."""

from __future__ import annotations

import inspect
import json
import re
import time

import pytest

from poolcore import state
from poolcore.config import load_settings
from poolcore.queues import make_celery, queue_name
from poolcore.state import LOCK_TTL, UNAVAILABLE, Store
from tests.conftest import wait_for
from tests.test_capacity import allocate

pytestmark = pytest.mark.unit


@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


# ---- the key families ------------------------------------------------------------------------
def test_the_docstring_lists_every_key_family():
    def family(key: str) -> str:
        assert key.startswith(state.PREFIX)
        return re.sub(r"<[^>]*>", "<>", key.removeprefix(state.PREFIX))

    lines = [re.sub(r"<[^>]*>", "<>", line) for line in state.__doc__.splitlines() if line.startswith("  ")]
    listed = {family(state.PREFIX + line.split()[0]) for line in lines}
    builders = [f for name, f in inspect.getmembers(state.keys, inspect.isfunction) if name.endswith("_key")]
    built = {family(f(*["<>"] * len(inspect.signature(f).parameters))) for f in builders}
    constants = {
        family(key) for key in (state.FAILURE_COUNTS, state.RETRY_COUNTS, state.RECENT_RUNS, state.HOSTS, state.MONITOR)
    }
    assert built | constants <= listed, "a key family missing from poolcore/state/__init__.py's docstring"
    assert len(builders) >= 19


# ---- the Lua scripts -------------------------------------------------------------------------
def test_allocate_writes_the_keys_the_key_functions_name(store, redis_server):
    run = allocate(store, "task-a", "req-1", max_tasks=1, max_runs=1)
    assert set(redis_server.keys("*")) == {
        state.run_key(run.run_id),
        state.host_tasks_key("h1"),
        state.host_live_key("h1"),
        state.request_key("task-a", "req-1"),
        state.RECENT_RUNS,
    }
    assert redis_server.hget(state.host_tasks_key("h1"), "task-a") == "1"
    assert redis_server.zscore(state.host_live_key("h1"), run.run_id) is not None
    assert redis_server.get(state.request_key("task-a", "req-1")) == run.run_id
    assert state.IDEMPOTENCY_TTL - 5 < redis_server.ttl(state.request_key("task-a", "req-1")) <= state.IDEMPOTENCY_TTL


def test_allocate_takes_the_idempotency_ttl_as_an_argument(store, redis_server, monkeypatch):
    monkeypatch.setattr(state.keys, "IDEMPOTENCY_TTL", 7)
    allocate(store, "task-a", "req-1", max_tasks=1, max_runs=1)
    assert 0 < redis_server.ttl(state.request_key("task-a", "req-1")) <= 7


def test_the_scripts_build_keys_under_the_prefix_they_are_given(store, redis_server, monkeypatch):
    monkeypatch.setattr(state.keys, "PREFIX", "other:")
    monkeypatch.setattr(state.keys, "RECENT_RUNS", "other:runs:recent")
    run = allocate(store, "task-a", "req-1", max_tasks=1, max_runs=1)
    again = allocate(store, "task-a", "req-1", max_tasks=1, max_runs=1)
    assert again.reused and again.run_id == run.run_id  # the reuse path reads the run under the prefix
    assert store.release(run.run_id) is True
    keys = set(redis_server.keys("*"))
    assert keys and all(key.startswith("other:") for key in keys), keys
    assert state.host_closing_key("h1") in keys and state.host_tasks_key("h1") not in keys  # its last run left


def test_release_moves_the_run_from_live_to_closing(store, redis_server):
    run = allocate(store, "task-a", "", max_tasks=1, max_runs=2)
    other = allocate(store, "task-a", "", max_tasks=1, max_runs=2)
    assert store.release(run.run_id, reason="closed") is True
    assert redis_server.hget(state.host_tasks_key("h1"), "task-a") == "1"
    assert redis_server.zrange(state.host_live_key("h1"), 0, -1) == [other.run_id]
    assert redis_server.smembers(state.host_closing_key("h1")) == {run.run_id}
    record = store.get_run(run.run_id)
    assert record["state"] == "closing" and record["closing_reason"] == "closed"


def test_releasing_an_unknown_run_writes_nothing(store, redis_server):
    assert store.release("run-0000000000000000") is False
    assert redis_server.keys("*") == []


def test_transition_only_from_the_given_states(store, redis_server):
    run = allocate(store, "task-a", "", max_tasks=1, max_runs=1)
    assert store.transition(run.run_id, ("allocated",), "starting") is True
    assert store.transition(run.run_id, ("allocated",), "starting") is False
    assert store.transition(run.run_id, ("running", "starting"), "running") is True
    assert store.get_run(run.run_id)["state"] == "running"
    assert store.transition("run-0000000000000000", ("allocated",), "starting") is False
    assert not redis_server.exists(state.run_key("run-0000000000000000"))


def test_set_state_if_live_writes_only_a_live_run(store, redis_server):
    run = allocate(store, "task-a", "", max_tasks=1, max_runs=1)
    assert store.set_state_if_live(run.run_id, "ready", env={"client": "c"}, score=None) is True
    record = store.get_run(run.run_id)
    assert record["state"] == "ready" and record["env"] == {"client": "c"}
    store.release(run.run_id)
    # A start that ends after the close: the close stands, and nothing of the start is written.
    assert store.set_state_if_live(run.run_id, "ready", env={"client": "late"}) is False
    assert store.get_run(run.run_id)["state"] == "closing"
    assert store.get_run(run.run_id)["env"] == {"client": "c"}
    assert store.set_state_if_live("run-0000000000000000", "ready") is False
    assert not redis_server.exists(state.run_key("run-0000000000000000"))


def test_a_run_reads_busy_while_its_tool_call_has_not_ended(store, redis_server):
    run = allocate(store, "task-a", "", max_tasks=1, max_runs=1)
    store.update_run(run.run_id, state="ready")
    store.use_run(run.run_id, call_job="job-1")
    assert store.shown_run(run.run_id)["state"] == "ready"  # no such job (a call refused after use)
    store.create_job("job-1", run.run_id, "tool_call")
    assert store.shown_run(run.run_id)["state"] == "busy"
    assert redis_server.hget(state.run_key(run.run_id), "state") == "ready"  # derived: nothing to undo
    store.begin_job("job-1", "exec@h1", "tok")
    assert store.shown_run(run.run_id)["state"] == "busy"
    store.job_finished("job-1", result="hi", worker="tok")
    # Ready again as soon as the job ends: before any waiter has woken.
    assert store.shown_run(run.run_id)["state"] == "ready"
    assert store.wait_job("job-1", timeout=1)["state"] == "succeeded"
    store.update_run(run.run_id, state="evaluated")
    store.use_run(run.run_id, call_job="job-2")
    store.create_job("job-2", run.run_id, "tool_call")
    assert store.shown_run(run.run_id)["state"] == "busy"
    store.job_finished("job-2", result="hi")
    assert store.shown_run(run.run_id)["state"] == "evaluated"  # a call after the evaluation keeps it
    # Only a started run reads busy: a run closed meanwhile stays closing.
    store.create_job("job-3", run.run_id, "tool_call")
    store.update_run(run.run_id, call_job="job-3")
    store.release(run.run_id)
    assert store.shown_run(run.run_id)["state"] == "closing"


# ---- locks -----------------------------------------------------------------------------------
def test_held_locks_name_build_locks_with_their_ttl(store):
    with store.build_lock("h1", "img:latest") as build:
        assert build.acquire()
        held = store.held_locks()
        assert set(held) == {state.build_lock_key("h1", "img:latest")}
        assert all(0 < left <= LOCK_TTL for left in held.values())
        assert not store.build_lock("h1", "img:latest").acquire()  # one build of an image per host
        other = store.build_lock("h2", "img:latest")
        assert other.acquire()  # another host builds its own
    with other:  # released at the end: its renewer must not outlive redis_server
        assert set(store.held_locks()) == {state.build_lock_key("h2", "img:latest")}


# ---- queue depths ----------------------------------------------------------------------------
def test_queue_depths_count_messages_of_every_priority(redis_server):
    """Store.queue_depths counts every message of a queue, whatever priority a sender gives it
    (kombu keeps one list per priority step: poolcore/priorities.py queue_lists)."""
    redis_server.flushdb()
    url = f"redis://127.0.0.1:{redis_server.connection_pool.connection_kwargs['port']}/0"
    celery = make_celery(load_settings({"REDIS_URL": url, "POOL_HOST_ID": "h1"}))
    exec_queue, build_queue, eval_queue = (queue_name("h1", kind) for kind in ("exec", "build", "eval"))
    try:
        for priority in (None, 0, 5, 9):
            celery.send_task("pool.exec_tool", kwargs={"host": "h1"}, priority=priority)
        celery.send_task("pool.ensure_image", kwargs={"host": "h1"})
    finally:
        celery.close()
    depths = Store(redis_server).queue_depths([exec_queue, build_queue, eval_queue])
    assert depths == {exec_queue: 4, build_queue: 1, eval_queue: 0}


def test_a_reader_without_redis_fails_fast():
    store = Store.from_url("redis://127.0.0.1:1/0", timeout=2)
    started = time.monotonic()
    with pytest.raises(UNAVAILABLE):
        store.queue_depths(["termpool.h1.exec"])
    assert time.monotonic() - started < 10


# ---- one round trip per use of a run and per job start; the monitor's announcement -----------
def test_use_run_marks_a_live_run_used_and_returns_its_record(store, redis_server):
    run = allocate(store, "task-a", "req-1", max_tasks=1, max_runs=1)
    before = redis_server.zscore(state.host_live_key("h1"), run.run_id)
    time.sleep(0.01)
    record = store.use_run(run.run_id)
    assert (record["run_id"], record["host"], record["state"]) == (run.run_id, "h1", "allocated")
    # The live zset's score is left as it was (the reaper reads last_used_at: idle_runs).
    assert redis_server.zscore(state.host_live_key("h1"), run.run_id) == before
    assert store.get_run(run.run_id)["last_used_at"] > before
    assert store.use_run("run-unknown") is None and store.use_run("") is None
    assert store.release(run.run_id)
    assert store.use_run(run.run_id) is None
    assert redis_server.zscore(state.host_live_key("h1"), run.run_id) is None  # never put back


def test_begin_job_starts_a_queued_job_once(store):
    store.create_job("j1", "run-1", "tool_call")
    assert store.begin_job("j1", "exec-a@h1", "tok-a", {"task": "pool.exec_tool"}, "m1:0", "a") == "queued"
    job = store.get_job("j1")
    assert (job["state"], job["node"], job["attempts"], job["worker"]) == ("running", "exec-a@h1", 1, "tok-a")
    assert job["started_at"] > 0 and json.loads(job["retry_with"]) == {"task": "pool.exec_tool"}
    assert store.worker_jobs("tok-a") == ["j1"]
    # a retry (its message's next delivery) on another process: moved there, still its first start
    started = job["started_at"]
    assert store.begin_job("j1", "exec-b@h1", "tok-b", delivery="m1:1", taker="b") == "running"
    job = store.get_job("j1")
    assert (job["node"], job["worker"], job["started_at"], job["attempts"]) == ("exec-b@h1", "tok-b", started, 1)
    store.job_left("j1", "tok-a")
    store.job_finished("j1", result="hi", worker="tok-b")
    assert store.worker_jobs("tok-a") == store.worker_jobs("tok-b") == []
    assert store.begin_job("j1", "exec-c@h1", "tok-c", delivery="m1:2", taker="c") == "succeeded"
    assert store.get_job("j1")["state"] == "succeeded" and store.worker_jobs("tok-c") == []  # settled: not listed
    assert store.begin_job("j-unknown", "exec-a@h1", "tok-a") is None
    assert store.get_job("j-unknown") is None  # nothing written for a job that has no record


def test_a_copy_of_a_job_s_message_never_runs_it_again(store):
    """A delivery (the message's id and retry count) is taken once: a copy of the message (a
    publish retried, a redelivery) gets "duplicate" and changes nothing, whether the job is
    queued, running or ended; the same taker's script sent again (Redis's client resending)
    goes on."""
    store.create_job("j1", "run-1", "tool_call")
    assert store.begin_job("j1", "exec-a@h1", "tok-a", delivery="m1:0", taker="a") == "queued"
    assert store.begin_job("j1", "exec-a@h1", "tok-a", delivery="m1:0", taker="a") == "running"  # resent
    assert store.begin_job("j1", "exec-b@h1", "tok-b", delivery="m1:0", taker="b") == "duplicate"
    job = store.get_job("j1")
    assert (job["node"], job["worker"], job["attempts"]) == ("exec-a@h1", "tok-a", 1)
    assert store.worker_jobs("tok-b") == []
    # a copy taken first, before the original: the original is then the copy
    store.create_job("j2", "run-1", "tool_call")
    assert store.begin_job("j2", "exec-b@h1", "tok-b", delivery="m2:0", taker="b") == "queued"
    assert store.begin_job("j2", "exec-a@h1", "tok-a", delivery="m2:0", taker="a") == "duplicate"


def test_counts_and_lists_are_written_once_when_a_command_is_sent_again(store, redis_server):
    """What Redis's client may send twice (its reply lost to a partition) changes nothing the
    second time: a job's record and its place in its run's list, its retry attempt and count,
    its end's count and wake-up, an episode's job list."""
    for _ in range(2):
        store.create_job("j1", "run-1", "tool_call")
    assert store.run_jobs("run-1") == ["j1"]
    for _ in range(2):
        store.job_retrying("j1", "pool.exec_tool", "DOCKER_ERROR", "boom", retries=1)
    assert store.get_job("j1")["attempts"] == 2
    assert redis_server.hget(state.RETRY_COUNTS, "pool.exec_tool|DOCKER_ERROR") == "1"
    # another step of the same job (a start's image build, then the start) retries on its own
    store.job_retrying("j1", "pool.start_run", "DOCKER_ERROR", "boom", retries=1)
    assert store.get_job("j1")["attempts"] == 3
    for _ in range(2):
        store.job_lost_retry("j1", "pool.exec_tool", "lost", retries=2)
    assert store.get_job("j1")["attempts"] == 4
    assert redis_server.hget(state.RETRY_COUNTS, "pool.exec_tool|WORKER_LOST") == "1"
    for _ in range(2):
        store.job_finished("j1", error="boom", code="DOCKER_ERROR")
    assert redis_server.hget(state.FAILURE_COUNTS, "DOCKER_ERROR") == "1"
    assert redis_server.llen(state.job_done_key("j1")) == 1
    for _ in range(2):
        store.set_episode_jobs("start-1", ["start-1", "j1"])
    assert store.episode_jobs("start-1") == ["start-1", "j1"]


def test_a_placement_or_a_warm_count_sent_again_changes_nothing(store, redis_server, monkeypatch):
    """The same script with the same arguments (what Redis's client resends): one run, one
    slot; a warm pool event counted once."""
    from poolcore.state import hosts

    monkeypatch.setattr(hosts, "new_run_id", lambda: "run-0000000000000001")
    first = allocate(store, "k", "", max_tasks=2, max_runs=2)
    again = allocate(store, "k", "", max_tasks=2, max_runs=2)
    assert first == again and redis_server.hget(state.host_tasks_key("h1"), "k") == "1"
    monkeypatch.setattr(state.warm.secrets, "token_hex", lambda n: "event-1")
    for _ in range(2):
        store.warm_count_event("h1", started=1, start_s=0.5)
    assert store.warm_counters("h1") == {"started": 1.0, "start_s": 0.5}


def test_use_run_for_a_tool_call_names_its_job(store):
    run = allocate(store, "k", "", max_tasks=1, max_runs=1)
    store.create_job("j-a", run.run_id, "tool_call")
    assert store.use_run(run.run_id, call_job="j-a")["state"] == "allocated"
    assert store.shown_run(run.run_id)["state"] == "allocated"  # not started: never busy
    assert store.get_run(run.run_id)["call_job"] == "j-a"
    store.update_run(run.run_id, state="ready")
    assert store.use_run(run.run_id)["state"] == "ready"  # the record as stored
    assert store.shown_run(run.run_id)["state"] == "busy"
    store.release(run.run_id)
    assert store.use_run(run.run_id, call_job="j-b") is None and store.use_run("", call_job="j-b") is None
    assert store.get_run(run.run_id)["call_job"] == "j-a"  # nothing written to a released run


def test_senders_publish_task_sent_events_while_a_monitor_announces_itself(store, redis_server, monkeypatch):
    from poolcore import queues

    monkeypatch.setattr(queues, "MONITOR_POLL", 0.05)
    port = redis_server.connection_pool.connection_kwargs["port"]
    cfg = load_settings({"REDIS_URL": f"redis://127.0.0.1:{port}/0", "POOL_HOST_ID": "h1"})
    app = make_celery(cfg)
    stop = queues.follow_monitor(app, cfg, store)
    try:
        assert store.monitor_listening() is False and app.conf.task_send_sent_event is False
        store.announce_monitor(ttl=1)
        assert store.monitor_listening() is True
        assert wait_for(lambda: app.conf.task_send_sent_event is True, 5, 0.02)
        assert wait_for(lambda: app.conf.task_send_sent_event is False, 5, 0.02)  # the announcement expired
    finally:
        stop.set()  # the session's redis-server goes at its end: the thread must not outlive this test
    always = load_settings({"REDIS_URL": cfg.redis_url, "TASK_EVENTS": "always"})
    loud = make_celery(always)
    assert queues.follow_monitor(loud, always, store) is None  # nothing to follow: always on
    assert loud.conf.task_send_sent_event is True


def test_ended_records_expire_after_the_record_ttl_setting(redis_server):
    redis_server.flushdb()
    store = Store(redis_server, record_ttl=load_settings({"RECORD_TTL": "120"}).record_ttl)
    run_id = allocate(store, "task-a", "", max_tasks=1, max_runs=1).run_id
    store.create_job("job-1", run_id, "tool_call")
    store.job_finished("job-1", result="ok")
    store.release(run_id)
    store.mark_closed(run_id)
    for key in (state.run_key(run_id), state.run_jobs_key(run_id), state.job_key("job-1")):
        assert 0 < redis_server.ttl(key) <= 120, key
