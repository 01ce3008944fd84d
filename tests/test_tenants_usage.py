"""A tenant's build and upload quotas in the state store's scripts alone (a private Redis, no
Docker; poolcore/state/quotas.py): the check and the take are one step, racing takers never
pass the limit, and what is taken is given back when the build ends, when its lease lapses (a
worker that died mid-build) and when an upload's holding lapses. docs/tenants.md, "Quotas"."""

from __future__ import annotations

import threading
import time

import pytest

from poolcore.failures import TenantQuotaExceeded
from poolcore.state import QuotaRefused, Store, keys
from tasks import build_quota

pytestmark = pytest.mark.unit


@pytest.fixture
def store(redis_server):
    redis_server.flushall()
    return Store(redis_server)


def running(redis_server, *jobs: str) -> None:
    """Job records under way: a lease counts while its job has not ended."""
    for job in jobs:
        redis_server.hset(keys.job_key(job), "state", "running")


def race(n: int, take) -> list:
    """`take(i)` for i in range(n), all at once: what each answered (its exception if it raised)."""
    answers: list = [None] * n

    def one(i: int) -> None:
        try:
            answers[i] = take(i)
        except QuotaRefused as exc:
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_racing_builds_never_pass_max_builds(store, redis_server):
    running(redis_server, "job-new", *(f"job-{i}" for i in range(12)))
    answers = race(12, lambda i: store.take_build("a", f"job-{i}", 3, 60))
    refused = [a for a in answers if isinstance(a, QuotaRefused)]
    assert len(refused) == 9 and all((r.used, r.limit) == (3, 3) for r in refused)
    assert store.builds_in_flight("a") == 3 and store.builds_in_flight("b") == 0
    taken = [f"job-{i}" for i, a in enumerate(answers) if not isinstance(a, QuotaRefused)]
    store.give_build("a", taken[0])
    assert store.take_build("a", "job-new", 3, 60) == 3


def test_a_job_sent_again_keeps_its_lease(store, redis_server):
    """A build whose worker was lost is sent again with the same job id: the same lease."""
    running(redis_server, "job-1", "job-2")
    assert store.take_build("a", "job-1", 1, 60) == 1
    assert store.take_build("a", "job-1", 1, 60) == 1
    with pytest.raises(QuotaRefused):
        store.take_build("a", "job-2", 1, 60)


def test_a_lost_workers_lease_lapses(store, redis_server):
    running(redis_server, "job-dead", "job-2")
    store.take_build("a", "job-dead", 1, 0.2)  # never given back: its worker died mid-build
    with pytest.raises(QuotaRefused):
        store.take_build("a", "job-2", 1, 60)
    time.sleep(0.3)
    assert store.builds_in_flight("a") == 0
    store.take_build("a", "job-2", 1, 60)


def test_a_lost_build_that_failed_gives_its_lease_back(store, redis_server):
    """A build lost twice is failed WORKER_LOST by another process: its lease goes at once."""
    running(redis_server, "job-lost", "job-2")
    store.take_build("a", "job-lost", 1, 600)
    with pytest.raises(QuotaRefused):
        store.take_build("a", "job-2", 1, 600)
    redis_server.hset(keys.job_key("job-lost"), "state", "failed")
    assert store.builds_in_flight("a") == 0
    store.take_build("a", "job-2", 1, 600)
    redis_server.delete(keys.job_key("job-2"))  # a record gone (expired) holds nothing either
    assert store.builds_in_flight("a") == 0


def test_the_workers_slot_gives_back_however_the_build_ends(store, redis_server):
    running(redis_server, "job-1", "job-2")
    store.publish_build_limits({"a": 1})
    run = {"run_id": "run-1", "tenant": "a"}
    with pytest.raises(RuntimeError), build_quota.slot(store, run, "job-1", 60)():
        assert store.builds_in_flight("a") == 1
        second = build_quota.slot(store, {**run, "run_id": "run-2"}, "job-2", 60)
        with pytest.raises(TenantQuotaExceeded, match=r"1 image builds in flight, its max_builds \(1\)"), second():
            pass
        raise RuntimeError("the build failed")
    assert store.builds_in_flight("a") == 0
    assert build_quota.slot(store, {"run_id": "run-3"}, "job-3", 60) is None  # the operator's run
    store.publish_build_limits({})
    assert store.tenant_max_builds("a") is None


def test_uploads_count_distinct_tasks_within_max_upload_bytes(store, redis_server):
    assert store.hold_upload("a", "task:1", 400, 1000, 60) is True
    assert store.hold_upload("a", "task:1", 400, 1000, 60) is False  # held already: counted once
    with pytest.raises(QuotaRefused) as refused:
        store.hold_upload("a", "task:2", 601, 1000, 60)
    assert (refused.value.used, refused.value.limit) == (400, 1000)
    assert not redis_server.exists(keys.blob_holders_key("task:2"))  # nothing recorded
    assert store.hold_upload("b", "task:2", 601, 1000, 60) is True  # another tenant's own quota
    assert store.hold_upload("a", "task:3", 600, 1000, 60) is True
    assert (store.upload_bytes("a"), store.upload_bytes("b")) == (1000, 601)
    store.drop_upload("a", "task:3")
    assert store.upload_bytes("a") == 400 and not store.blob_held_by("task:3", "a", 60)


def test_racing_uploads_never_pass_max_upload_bytes(store):
    answers = race(10, lambda i: store.hold_upload("a", f"task:{i}", 300, 1000, 60))
    assert answers.count(True) == 3 and store.upload_bytes("a") == 900


def test_an_uploads_bytes_return_when_its_holding_lapses(store):
    store.hold_upload("a", "task:1", 700, 1000, 0.2)
    with pytest.raises(QuotaRefused):
        store.hold_upload("a", "task:2", 700, 1000, 60)
    time.sleep(0.3)  # the blob and its holders expired (UPLOADED_TASK_TTL)
    assert store.upload_bytes("a") == 0
    assert store.hold_upload("a", "task:2", 700, 1000, 60) is True
