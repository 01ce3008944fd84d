"""The pool dashboard's last hour (poolcore/state/recent.py) against a bare redis-server:
latency classes and percentiles, requests and error replies by tenant, failed jobs counted by
the finish script under their run's tenant, and the window of an hour."""

from __future__ import annotations

import pytest
import redis

from app.recent_requests import RecentRequests
from poolcore.state import NO_TENANT, Store, keys
from poolcore.state.recent import CLASS_RATIO, latency_class, minute, percentile
from tests.conftest import wait_for

pytestmark = pytest.mark.unit


@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


@pytest.mark.parametrize("seconds", [0.0004, 0.0031, 0.0087, 0.25, 4.2, 95.0])
def test_a_percentile_is_within_a_class_of_the_truth(seconds):
    ms = seconds * 1000
    counts = {latency_class(seconds): 10}
    for q in (0.5, 0.95):
        got = percentile(counts, q)
        assert (ms / CLASS_RATIO <= got <= ms * CLASS_RATIO) if ms > 1 else got <= 1


def test_percentiles_split_a_mix():
    counts = {latency_class(0.005): 90, latency_class(2.0): 10}
    assert percentile(counts, 0.5) < 6
    assert 2000 / CLASS_RATIO < percentile(counts, 0.95) <= 2000 * CLASS_RATIO
    assert percentile({}, 0.5) == 0.0


def test_requests_and_errors_by_tenant(store, redis_server):
    for _ in range(3):
        store.record_request("team-a", "pool.allocate", 0.004)
    store.record_request("team-a", "pool.heartbeat", 0.002, "UNKNOWN_LEASE")
    store.record_request(NO_TENANT, "pool.allocate", 0.008, "RUN_SLOTS_EXHAUSTED")
    everyone, team_a = store.recent_activity(), store.recent_activity("team-a")
    assert everyone["latency"]["pool.allocate"]["requests"] == 4
    assert team_a["latency"]["pool.allocate"]["requests"] == 3
    assert 4 / CLASS_RATIO <= team_a["latency"]["pool.allocate"]["p50_ms"] <= 4 * CLASS_RATIO
    assert everyone["errors"] == {"RUN_SLOTS_EXHAUSTED": 1, "UNKNOWN_LEASE": 1}
    assert team_a["errors"] == {"UNKNOWN_LEASE": 1}
    assert store.recent_activity("team-b") == {**team_a, "latency": {}, "errors": {}}
    now = minute()
    for key in (keys.recent_requests_key(now), keys.recent_errors_key(now)):
        assert 0 < redis_server.ttl(key) <= keys.RECENT_TTL


def test_the_window_is_the_last_hour(store):
    store.record_request("team-a", "pool.reset", 1.5)
    in_an_hour = (minute() + 60) * 60
    assert store.recent_activity(now=in_an_hour - 60)["latency"]["pool.reset"]["requests"] == 1
    assert store.recent_activity(now=in_an_hour)["latency"] == {}


def test_a_failed_job_counts_under_its_runs_tenant(store, redis_server):
    redis_server.hset(keys.run_key("run-a"), mapping={"state": "ready", "tenant": "team-a"})
    redis_server.hset(keys.run_key("run-op"), mapping={"state": "ready", "tenant": ""})
    for job, run in (("job-1", "run-a"), ("job-2", "run-op"), ("job-3", "run-a")):
        store.create_job(job, run, "start")
    store.job_finished("job-1", error="no image", code="START_FAILED")
    store.job_finished("job-2", error="gone", code="HOST_LOST")
    store.job_finished("job-3", result={"ok": True})
    store.job_finished("job-1", error="again", code="START_FAILED")  # a late second end counts once
    assert store.recent_activity()["job_failures"] == {"HOST_LOST": 1, "START_FAILED": 1}
    assert store.recent_activity("team-a")["job_failures"] == {"START_FAILED": 1}
    assert store.recent_activity(NO_TENANT)["job_failures"] == {"HOST_LOST": 1}
    assert store.failure_counts() == {"HOST_LOST": 1, "START_FAILED": 1}


def test_answered_requests_are_written_in_batches(store):
    """The facade's record (app/recent_requests.py): nothing on a request's path, the counts
    summed and written by the process's writer thread, each error reply by its code."""
    recent = RecentRequests(lambda: store, interval=0.1)
    try:
        for _ in range(3):
            recent.add("team-a", "pool.allocate", 0.004)
        recent.add(NO_TENANT, "pool.close", 0.002, "UNKNOWN_LEASE")
        assert wait_for(lambda: store.recent_activity()["latency"].get("pool.allocate", {}).get("requests") == 3, 5)
        assert store.recent_activity()["errors"] == {"UNKNOWN_LEASE": 1}
        assert store.recent_activity("team-a")["latency"]["pool.allocate"]["requests"] == 3
    finally:
        recent.stop()


def test_counts_redis_refuses_are_dropped_quietly(store):
    def away() -> Store:
        raise redis.exceptions.ConnectionError("Redis not reached")

    recent = RecentRequests(away, interval=3600)
    recent.add("team-a", "pool.allocate", 0.004)
    recent.flush()  # no error: the dashboard misses a second, the request was answered
    recent.store = lambda: store
    recent.flush()
    assert store.recent_activity()["latency"] == {}
    recent.stop()
