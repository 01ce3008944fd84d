"""The idle reaper's decision (RunsState.release_if_idle) against a bare redis-server: a run is
idle only when its last use is old enough and no job of it is working, whatever the job's kind;
its idle clock starts again when its last job ends. (tests/test_reaper.py runs long calls of
each kind through the real stack.)"""

from __future__ import annotations

import time

import pytest

from poolcore import state
from poolcore.state import Store
from tests.test_capacity import allocate

pytestmark = pytest.mark.unit
TTL = 3.0
LONG_AGO = 100.0


@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


def old_run(store: Store, redis_server) -> str:
    """A started run allocated and last used LONG_AGO seconds ago: idle unless a job holds it."""
    run_id = allocate(store, "task-a", "", max_tasks=4, max_runs=8).run_id
    store.update_run(run_id, state="ready", last_used_at=time.time() - LONG_AGO)
    redis_server.zadd(state.host_live_key("h1"), {run_id: time.time() - LONG_AGO})
    return run_id


def running_job(store: Store, run_id: str, kind: str) -> str:
    job_id = f"{kind}-{run_id}"
    store.create_job(job_id, run_id, kind)
    store.begin_job(job_id, "node@h1", token="w1")
    store.update_run(run_id, last_used_at=time.time() - LONG_AGO)  # the job began long ago
    return job_id


@pytest.mark.parametrize("kind", ["tool_call", "command", "evaluation", "fork", "archive_import", "start"])
def test_a_run_with_a_running_job_is_not_idle_and_its_clock_starts_when_the_job_ends(store, redis_server, kind):
    run_id = old_run(store, redis_server)
    job_id = running_job(store, run_id, kind)
    assert not store.release_if_idle(run_id, TTL), f"a run was reaped under its {kind} job"
    assert store.get_run(run_id)["state"] == "ready"
    store.job_finished(job_id, result="ok", worker="w1")
    assert time.time() - store.get_run(run_id)["last_used_at"] < 2, "the job's end did not count as use"
    assert not store.release_if_idle(run_id, TTL), "a run whose job just ended was reaped"
    assert store.release_if_idle(run_id, 0.0), "a run with no job working and an old use was kept"
    assert store.get_run(run_id)["closing_reason"] == "idle"


def test_a_blocking_tool_call_recorded_with_its_use_holds_the_run(store, redis_server):
    """The facade records a tool call with the run's use (use_run): the call holds the run from
    that moment, before any worker takes it."""
    run_id = old_run(store, redis_server)
    job = store.job_fields("call-1", run_id, "tool_call")
    store.use_run(run_id, call_job="call-1", job=job)
    store.update_run(run_id, last_used_at=time.time() - LONG_AGO)
    assert not store.release_if_idle(run_id, TTL)
    store.job_finished("call-1", error="boom", code="INTERNAL")  # a failure ends the work too
    assert store.release_if_idle(run_id, 0.0)


def test_a_job_queued_past_the_cutoff_holds_nothing_and_an_expired_one_leaves_the_set(store, redis_server):
    run_id = old_run(store, redis_server)
    store.create_job("fresh", run_id, "evaluation")
    store.update_run(run_id, last_used_at=time.time() - LONG_AGO)
    assert not store.release_if_idle(run_id, TTL), "a job queued a moment ago did not hold the run"
    redis_server.hset(state.job_key("fresh"), "queued_at", time.time() - LONG_AGO)  # its message was lost
    store.create_job("gone", run_id, "command")
    redis_server.delete(state.job_key("gone"))  # expired without ending
    assert store.release_if_idle(run_id, TTL), "a job queued long ago (never taken) held the run"
    assert redis_server.smembers(state.run_working_key(run_id)) == {"fresh"}


def test_a_fork_child_is_held_while_its_source_s_fork_job_runs(store, redis_server):
    child = old_run(store, redis_server)
    source = old_run(store, redis_server)
    job_id = running_job(store, source, "fork")
    store.update_run(child, fork_job=job_id, state="starting")
    assert not store.release_if_idle(child, TTL)
    store.job_finished(job_id, result="ok")
    assert store.release_if_idle(child, TTL)


def test_a_discarded_call_and_a_closed_run_leave_no_working_set(store, redis_server):
    run_id = old_run(store, redis_server)
    store.use_run(run_id, call_job="refused", job=store.job_fields("refused", run_id, "tool_call"))
    store.discard_job("refused", run_id)
    assert not redis_server.exists(state.run_working_key(run_id))
    store.create_job("close-1", run_id, "close")
    store.release(run_id)
    store.mark_closed(run_id)
    assert not redis_server.exists(state.run_working_key(run_id))


def test_a_call_beginning_after_the_reaper_looked_wins(store, redis_server):
    """The reaper lists candidates (idle_runs), then releases each with the check made again in
    the same script: a call that began between the two keeps its run."""
    run_id = old_run(store, redis_server)
    assert store.idle_runs("h1", TTL) == [run_id]
    store.touch(run_id)
    assert not store.release_if_idle(run_id, TTL)
