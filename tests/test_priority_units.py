"""Priority classes without Docker (docs/tenants.md, Priorities): a run's class from its tenant's
and what it asks (tenant default, lower allowed, higher refused), the request models' field,
the class recorded at placement and copied to fork children, and kombu's Redis lists of a queue as Store.queue_depths counts them (a private Redis, real
messages sent through termpool's Celery app)."""

from __future__ import annotations

import dataclasses

import pytest
from celery import Celery

from app.models import AllocateRequest, RunRequest
from devstack import FIXTURES
from poolcore import hosts, priorities
from poolcore.config import load_settings
from poolcore.queues import make_celery, queue_name
from poolcore.state import Store
from tests.test_placement import see

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("asked", "ceiling", "expected"),
    [
        (None, "eval", "eval"),  # a tenant's runs default to its class
        (None, "train", "train"),
        ("train", "eval", "train"),  # a lower class may be asked for
        ("eval", "eval", "eval"),
        ("train", "train", "train"),
        (None, None, priorities.DEFAULT),  # the operator's: train unless asked
        ("eval", None, "eval"),  # the operator may ask for any class
    ],
)
def test_a_runs_class(asked, ceiling, expected):
    assert priorities.resolve(asked, ceiling) == expected


def test_a_higher_class_than_the_tenants_is_refused():
    with pytest.raises(priorities.PriorityNotAllowed, match="above this tenant's class 'train'"):
        priorities.resolve("eval", "train")


def test_eval_is_taken_before_train():
    assert priorities.level("eval") < priorities.level("train")  # Redis: the lower number first
    assert priorities.level(None) == priorities.level("train") == priorities.level("unknown")
    assert sorted({priorities.level(name) for name in priorities.CLASSES}) == priorities.STEPS


def test_the_request_models_take_a_known_class_or_none():
    assert AllocateRequest.model_validate({"task_key": "k"}).priority is None
    assert AllocateRequest.model_validate({"task_key": "k", "priority": "eval"}).priority == "eval"
    meta = {"task_name": "t", "task_path": "hello-file", "instruction": "i"}
    context = {"cfg": load_settings({"DATASET_DIR": str(FIXTURES)})}
    assert RunRequest.model_validate({"task_meta": meta, "priority": "train"}, context=context).priority == "train"
    for bad in ("urgent", 1, ""):
        with pytest.raises(ValueError):
            AllocateRequest.model_validate({"task_key": "k", "priority": bad})


@pytest.fixture
def app(redis_server) -> Celery:
    redis_server.flushall()
    port = redis_server.connection_pool.connection_kwargs["port"]
    celery = make_celery(load_settings({"REDIS_URL": f"redis://127.0.0.1:{port}/0", "POOL_HOST_ID": "h"}))
    yield celery
    celery.close()


def test_queue_depths_count_the_messages_of_every_class(app, redis_server):
    """Sent as dispatch sends them (a run's class, or none: the route's default): each class in
    its own Redis list, and the depth is their sum."""
    queue = queue_name("h", "exec")
    for priority in ("train", "eval", "train", None):
        options = {} if priority is None else {"priority": priorities.level(priority)}
        app.send_task("pool.exec_tool", kwargs={"host": "h"}, **options)
    lists = priorities.queue_lists(queue)
    assert [redis_server.llen(name) for name in lists] == [1, 3]  # eval's; train's and the default's
    assert Store(redis_server).queue_depths([queue, queue_name("h", "eval")]) == {queue: 4, f"{queue[:-4]}eval": 0}


def test_the_class_is_recorded_at_placement_and_kept_by_fork_children(redis_server):
    """_PLACE records the run's class; _FORK_PLACE copies it to the children (a private Redis)."""
    redis_server.flushall()
    store = Store(redis_server)
    cfg = load_settings({"POOL_HOST_ID": "h"})
    watch = hosts.make_watch(cfg, store)
    see(store, watch, "h", max_tasks=2, max_runs=3)
    rule = hosts.placement(cfg, watch)
    assert rule.priority == priorities.DEFAULT
    source = store.place("k", "", "k", dataclasses.replace(rule, priority="eval")).run_id
    default = store.place("k", "", "k", rule).run_id
    assert (store.run_priority(source), store.get_run(default)["priority"]) == ("eval", "train")
    store.update_run(source, state="ready")
    store.place_fork(source, ["run-child"], "job-f", 3, 3)
    assert store.run_priority("run-child") == "eval"


def test_a_close_records_its_teardown_and_reads_the_class_in_the_release(redis_server):
    """release_for_close: the teardown's job recorded under the released run, and the run's
    class answered by the same script (the close's one round trip); nothing for a run not live."""
    redis_server.flushall()
    store = Store(redis_server)
    cfg = load_settings({"POOL_HOST_ID": "h"})
    watch = hosts.make_watch(cfg, store)
    see(store, watch, "h", max_tasks=2, max_runs=3)
    rule = dataclasses.replace(hosts.placement(cfg, watch), priority="eval")
    run_id = store.place("k", "", "k", rule).run_id
    assert store.release_for_close(run_id, store.job_fields("job-c", run_id, "close")) == ("h", "eval")
    assert store.run_state(run_id) == "closing" and store.get_job("job-c")["kind"] == "close"
    assert store.release_for_close(run_id, store.job_fields("job-d", run_id, "close")) == (None, None)
    assert store.get_job("job-d") is None
