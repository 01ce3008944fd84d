"""Priority classes on one real stack, over HTTP (docs/tenants.md, Priorities): a train tenant
and an eval tenant on one host whose exec pool is one worker slot, held by a command that waits
for the test's word. With train jobs queued behind it and then an eval job, the eval job starts
before every train job sent before it (job records' started_at), the queue depth counts both
classes while they wait, and a run's class is its tenant's, lower on request, never higher."""

from __future__ import annotations

import pytest

from poolcore.queues import queue_name
from poolcore.state import Store
from termpool.client import Pool, PriorityNotAllowed
from tests.conftest import private_stack, run_containers, wait_for
from tests.test_tenants import call

ADMIN = "admin-token-prio-0000"
TRAIN, EVAL = "train-token-prio-1111", "eval-token-prio-2222"
TENANTS = f"""\
tenants:
  trainer:
    token: {TRAIN}
    priority: train
  evaluator:
    token: {EVAL}
    priority: eval
"""
QUEUED_TRAIN = 8  # train jobs queued behind the blocker before the eval job
GO = "/tmp/priority-go"


@pytest.fixture(scope="module")
def pool(docker_client, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    env = {"POOL_API_TOKEN": ADMIN, "TENANTS_FILE": str(path), "EXEC_CONCURRENCY": "1"}
    yield from private_stack(docker_client, env)


def start(stack, token: str, **extra) -> dict:
    """A started hello-file run of the token's tenant: its record."""
    body = {"task_meta": {"task_name": "hello-file", "task_path": "hello-file", "instruction": "x"}, **extra}
    reply = call(stack, token, "POST", "/v1/runs", body)
    assert reply.status_code == 202, reply.text
    job = finished(stack, reply.json()["job_id"])
    assert job["state"] == "succeeded", job
    return run_record(stack, token, reply.json()["run_id"])


def run_record(stack, token: str, run_id: str) -> dict:
    reply = call(stack, token, "GET", f"/v1/runs/{run_id}")
    assert reply.status_code == 200, reply.text
    return reply.json()["run"]


def command(stack, token: str, run_id: str, text: str) -> str:
    reply = call(stack, token, "POST", f"/v1/runs/{run_id}/commands", {"command": text, "timeout_sec": 600})
    assert reply.status_code == 202, reply.text
    return reply.json()["job_id"]


def finished(stack, job_id: str, rounds: int = 5) -> dict:
    """The job's record once it has ended (long polls of up to 60 s each, as the operator)."""
    for _ in range(rounds):
        reply = call(stack, ADMIN, "GET", f"/v1/jobs/{job_id}?wait=60")
        assert reply.status_code == 200, reply.text
        if reply.json()["job"]["state"] in ("succeeded", "failed"):
            break
    return reply.json()["job"]


@pytest.fixture
def runs(pool):
    """A started run of each tenant, closed after the test."""
    started = start(pool, TRAIN), start(pool, EVAL)
    yield started
    close(pool, *(run["run_id"] for run in started))


def close(stack, *run_ids: str) -> None:
    for run_id in run_ids:
        assert call(stack, ADMIN, "POST", "/close", {"lease_id": run_id}).status_code == 200


def test_an_eval_job_starts_before_the_train_jobs_queued_before_it(pool, runs, docker_client):
    trainer, evaluator = runs
    assert (trainer["priority"], evaluator["priority"]) == ("train", "eval")
    # The host's one exec slot is held until the test creates GO in the trainer's container.
    blocker = command(pool, TRAIN, trainer["run_id"], f"while [ ! -e {GO} ]; do sleep 0.1; done")
    store = Store(pool.redis)
    assert wait_for(lambda: store.get_job(blocker)["state"] == "running", 60), store.get_job(blocker)
    train_jobs = [command(pool, TRAIN, trainer["run_id"], f"echo train {i}") for i in range(QUEUED_TRAIN)]
    eval_job = command(pool, EVAL, evaluator["run_id"], "echo eval")
    queue = queue_name(pool.host_id, "exec")
    assert store.queue_depths([queue])[queue] == QUEUED_TRAIN + 1  # both classes' lists counted
    assert all(store.get_job(j)["state"] == "queued" for j in [*train_jobs, eval_job])

    (container,) = run_containers(docker_client, store, trainer["run_id"])
    container.exec_run(["touch", GO])
    ended = {j: finished(pool, j) for j in [blocker, *train_jobs, eval_job]}
    assert all(record["state"] == "succeeded" for record in ended.values()), ended
    eval_started = ended[eval_job]["started_at"]
    later = [j for j in train_jobs if ended[j]["started_at"] < eval_started]
    assert not later, f"train jobs sent before the eval job started before it: {later}"
    # Within a class, the order they were sent in; one slot: each starts after the last ended.
    starts = [ended[j]["started_at"] for j in train_jobs]
    assert starts == sorted(starts)
    assert ended[eval_job]["finished_at"] <= min(starts)


def test_a_run_may_ask_for_a_lower_class_never_a_higher(pool):
    lower = start(pool, EVAL, priority="train")
    assert lower["priority"] == "train"
    before = Store(pool.redis).host_status(pool.host_id)["total_active_runs"]
    for path, body in (
        ("/allocate", {"task_key": "hello-file", "priority": "eval"}),
        (
            "/v1/runs",
            {"task_meta": {"task_name": "t", "task_path": "hello-file", "instruction": "x"}, "priority": "eval"},
        ),
    ):
        reply = call(pool, TRAIN, "POST", path, body)
        assert reply.status_code == 403, reply.text
        assert reply.json()["code"] == "PRIORITY_NOT_ALLOWED" and "above this tenant's class" in reply.json()["error"]
    assert Store(pool.redis).host_status(pool.host_id)["total_active_runs"] == before  # nothing taken
    with Pool(pool.url, token=TRAIN, retries=0) as client, pytest.raises(PriorityNotAllowed):
        client.allocate("hello-file", priority="eval")  # the client's typed error
    operator = call(pool, ADMIN, "POST", "/allocate", {"task_key": "hello-file"})
    assert run_record(pool, ADMIN, operator.json()["lease_id"])["priority"] == "train"
    chosen = call(pool, ADMIN, "POST", "/allocate", {"task_key": "hello-file", "priority": "eval"})
    assert run_record(pool, ADMIN, chosen.json()["lease_id"])["priority"] == "eval"
    close(pool, lower["run_id"], operator.json()["lease_id"], chosen.json()["lease_id"])
