"""Routing of Celery tasks to queues, and the chains the facade sends: no Docker, no workers.

The chains are sent for real, to a Celery app whose broker is a bare redis-server; the tests
read the first step's message off its queue, with the rest of the chain embedded in it.
"""

from __future__ import annotations

import pytest

from poolcore import dispatch
from poolcore.config import QUEUE_KINDS, load_settings
from poolcore.queues import JOB_KINDS, MAINTENANCE_QUEUE, make_celery, queue_name, route_job
from poolcore.state import Store

pytestmark = pytest.mark.unit

HOST = "h1"
TASK_PATH = "hello-file"


def queue_of(name: str, kwargs: dict | None) -> str:
    route = route_job(name, (), kwargs, {})
    queue = route["queue"]
    return queue if isinstance(queue, str) else queue.name


# ---- routing -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(JOB_KINDS))
def test_pool_task_goes_to_its_hosts_queue_of_its_kind(name):
    assert JOB_KINDS[name] in QUEUE_KINDS
    assert queue_of(name, {"host": HOST, "run_id": "run-0"}) == f"termpool.{HOST}.{JOB_KINDS[name]}"
    assert queue_of(name, {"host": "h2"}) == f"termpool.h2.{JOB_KINDS[name]}"


def test_each_queue_kind_has_its_tasks():
    assert sorted(set(JOB_KINDS.values())) == sorted(QUEUE_KINDS)
    assert queue_of("pool.exec_tool", {"host": HOST}) == f"termpool.{HOST}.exec"
    assert queue_of("pool.ensure_image", {"host": HOST}) == f"termpool.{HOST}.build"
    assert queue_of("pool.close_run", {"host": HOST}) == f"termpool.{HOST}.teardown"


@pytest.mark.parametrize("name", ["pool.reap", "pool.reconcile_hosts"])
def test_maintenance_tasks_go_to_the_maintenance_queue(name):
    assert queue_of(name, {}) == MAINTENANCE_QUEUE
    assert queue_of(name, None) == MAINTENANCE_QUEUE


@pytest.mark.parametrize("kwargs", [None, {}, {"host": ""}, {"host": None}, {"run_id": "run-0"}])
def test_pool_task_without_a_host_is_refused(kwargs):
    with pytest.raises(ValueError, match="needs a host"):
        route_job("pool.exec_tool", (), kwargs, {})


# ---- chains --------------------------------------------------------------------------------
@pytest.fixture
def store(redis_server):
    redis_server.flushdb()
    return Store(redis_server)


@pytest.fixture
def celery(redis_server):
    port = redis_server.connection_pool.connection_kwargs["port"]
    app = make_celery(load_settings({"REDIS_URL": f"redis://127.0.0.1:{port}/0", "POOL_HOST_ID": HOST}))
    yield app
    app.close()


def sent(celery) -> list[dict]:
    """Every message waiting in the host's and the maintenance queue, taken off through kombu:
    its queue, task name, id, kwargs and the rest of its chain (name, id, kwargs of each later
    step, in order)."""
    messages = []
    with celery.connection_for_read() as connection:
        channel = connection.default_channel
        for queue in [queue_name(HOST, kind) for kind in QUEUE_KINDS] + [MAINTENANCE_QUEUE]:
            while (message := channel.basic_get(queue, no_ack=True)) is not None:
                _, kwargs, embed = message.decode()  # Celery's message protocol 2
                rest = [(s["task"], s["options"]["task_id"], s["kwargs"]) for s in reversed(embed.get("chain") or [])]
                headers = message.headers
                messages.append(
                    {"queue": queue, "task": headers["task"], "id": headers["id"], "kwargs": kwargs, "rest": rest}
                    | {"priority": message.properties.get("priority"), "levels": _levels(embed)}
                )
    return messages


def _levels(embed: dict) -> list:
    """The priority of each later step of the chain, and of its error callbacks, in order."""
    steps = list(reversed(embed.get("chain") or []))
    return [s["options"].get("priority") for s in steps] + [
        e["options"].get("priority") for e in embed["errbacks"] or []
    ]


def test_start_builds_the_image_until_the_host_has_it(celery, store):
    ids = {"host": HOST, "run_id": "run-1", "job_id": "job-1"}
    steps = dispatch.start_steps(celery, store, "run-1", HOST, "job-1", TASK_PATH)
    assert [(s.task, s.id, s.kwargs) for s in steps] == [
        ("pool.ensure_image", "job-1.image", {**ids, "final": False}),
        ("pool.start_run", "job-1", ids),
    ]
    store.mark_image_ready(HOST, TASK_PATH)
    steps = dispatch.start_steps(celery, store, "run-1", HOST, "job-1", TASK_PATH)
    assert [(s.task, s.id) for s in steps] == [("pool.start_run", "job-1")]
    store.mark_image_ready(HOST, "another-task")  # another task's image is no help
    assert len(dispatch.start_steps(celery, store, "run-1", HOST, "job-1", "other")) == 2


def test_reset_is_sent_to_the_build_queue_then_to_the_lifecycle_queue(celery, store):
    job = dispatch.enqueue_start(celery, store, "run-1", HOST, TASK_PATH)
    [message] = sent(celery)
    assert (message["queue"], message["task"], message["id"]) == (
        f"termpool.{HOST}.build",
        "pool.ensure_image",
        f"{job}.image",
    )
    assert [(name, task_id) for name, task_id, _ in message["rest"]] == [("pool.start_run", job)]
    assert store.get_job(job)["kind"] == "start"


def test_reset_of_a_built_task_goes_straight_to_the_lifecycle_queue(celery, store):
    store.mark_image_ready(HOST, TASK_PATH)
    job = dispatch.enqueue_start(celery, store, "run-1", HOST, TASK_PATH)
    [message] = sent(celery)
    assert (message["queue"], message["task"], message["id"], message["rest"]) == (
        f"termpool.{HOST}.lifecycle",
        "pool.start_run",
        job,
        [],
    )


def test_episode_steps_in_order_with_their_job_ids(celery, store):
    store.mark_image_ready(HOST, TASK_PATH)
    script = [
        {"name": "shell_exec", "arguments": {"id": "main", "command": "ls"}},
        {"name": "shell_view", "arguments": {"id": "main"}},
    ]
    jobs = dispatch.enqueue_episode(
        celery, store, "run-1", HOST, "start-1", TASK_PATH, script, evaluate=True, close=True
    )
    assert jobs["start"] == "start-1" and len(jobs["tool_calls"]) == 2 and jobs["evaluation"] and jobs["close"]
    [message] = sent(celery)
    assert (message["queue"], message["task"], message["id"]) == (
        f"termpool.{HOST}.lifecycle",
        "pool.start_run",
        "start-1",
    )
    close = jobs["close"]
    assert [(name, task_id) for name, task_id, _ in message["rest"]] == [
        ("pool.exec_tool", jobs["tool_calls"][0]),
        ("pool.exec_tool", jobs["tool_calls"][1]),
        ("pool.evaluate", jobs["evaluation"]),
        (dispatch.RELEASE_TASK, f"{close}.release"),
        ("pool.close_run", close),
    ]
    # each tool call step carries its own call; every step names the run and its host
    assert [kwargs["tool_call"] for name, _, kwargs in message["rest"][:2]] == script
    assert all(kwargs["host"] == HOST and kwargs["run_id"] == "run-1" for _, _, kwargs in message["rest"])
    # the steps' queues, as each one is sent on by the worker before it
    assert [queue_of(name, kwargs) for name, _, kwargs in message["rest"]] == [
        f"termpool.{HOST}.{kind}" for kind in ("exec", "exec", "eval", "teardown", "teardown")
    ]
    # every step's job record exists before the chain runs, in chain order for the error callback
    order = ["start-1", *jobs["tool_calls"], jobs["evaluation"], close]
    assert store.episode_jobs("start-1") == order
    assert [store.get_job(j)["kind"] for j in order] == ["start", "tool_call", "tool_call", "evaluation", "close"]


def test_episode_without_evaluation_or_close_stops_after_the_script(celery, store):
    script = [{"name": "shell_exec", "arguments": {"id": "main", "command": "true"}}]
    jobs = dispatch.enqueue_episode(celery, store, "run-1", HOST, "start-1", TASK_PATH, script)
    assert jobs["evaluation"] is None and jobs["close"] is None
    [message] = sent(celery)
    assert message["task"] == "pool.ensure_image" and message["queue"] == f"termpool.{HOST}.build"
    assert [name for name, _, _ in message["rest"]] == ["pool.start_run", "pool.exec_tool"]
    assert store.episode_jobs("start-1") == ["start-1", *jobs["tool_calls"]]


@pytest.mark.parametrize(("priority", "level"), [("eval", 0), ("train", 5), (None, 5)])
def test_every_step_of_a_runs_chain_carries_its_class(celery, store, priority, level):
    """An episode (start, tool call, evaluation, close) sent at the run's class: the first
    message and every later step it carries, the error callback too (poolcore/priorities.py)."""
    script = [{"name": "shell_exec", "arguments": {"command": "true"}}]
    dispatch.enqueue_episode(celery, store, "run-1", HOST, "start-1", TASK_PATH, script, True, True, priority)
    [message] = sent(celery)
    assert message["priority"] == level
    assert message["levels"] == [level] * (len(message["rest"]) + 1)
    dispatch.enqueue_close(celery, store, "run-1", HOST)  # no class in a record: the default's
    assert [m["priority"] for m in sent(celery)] == [5]
