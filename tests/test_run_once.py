"""Every job runs at most once, against the real stack: a copy of a job's message (what a
publish retried after a partition, or a redelivery, leaves in a queue) is dropped by the worker
that takes it, and a request sent again with its Idempotency-Key answers the first request's
job instead of queuing another. The calls append a line to a file in the run's container: each
must be there exactly once."""

from __future__ import annotations

import time

import pytest
import requests

from poolcore import dispatch
from poolcore.config import load_settings
from poolcore.queues import make_celery
from poolcore.state import Store
from tests.conftest import wait_for
from tests.test_runs_api import assert_error, finished, submit

LOG = "/tmp/calls.log"


@pytest.fixture(scope="module")
def run_id(stack) -> str:
    started = submit(stack, "hello-file")
    assert finished(stack, started["job_id"])["state"] == "succeeded"
    yield started["run_id"]
    requests.delete(f"{stack.url}/v1/runs/{started['run_id']}", timeout=30)


def lines(stack, run_id: str) -> list[str]:
    reply = post(stack, run_id, "commands", {"command": f"touch {LOG}; cat {LOG}"})
    job = finished(stack, reply.json()["job_id"])
    return job["result"]["stdout"].split()


def post(stack, run_id: str, what: str, body: dict | None = None, key: str | None = None) -> requests.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return requests.post(f"{stack.url}/v1/runs/{run_id}/{what}", json=body or {}, headers=headers, timeout=60)


def append(name: str) -> dict:
    return {"command": f"echo {name} >> {LOG}"}


def test_a_copy_of_a_tool_call_s_message_is_dropped(stack, run_id):
    """The same message sent twice to the run's exec queue (same task id, same job): the call
    runs once; the copy, taken while the call runs or after, changes nothing."""
    store = Store(stack.redis)
    call = {"name": "shell_exec", "arguments": {"id": "main", "command": "sleep 2; echo copy >> " + LOG}}
    reply = post(stack, run_id, "tool_calls", call)
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["job_id"]
    celery = make_celery(load_settings(stack.env))
    run = store.get_run(run_id)
    for _ in range(2):  # while the first runs, and again
        dispatch.send_tool_call(celery, run_id=run_id, host=run["host"], tool_call=call, job_id=job_id, env=run["env"])
    assert finished(stack, job_id)["state"] == "succeeded"
    assert wait_for(lambda: stack.logs("exec").count(f"job {job_id}: a copy of its message") == 2, 30)
    assert lines(stack, run_id).count("copy") == 1
    assert store.get_job(job_id)["attempts"] == 1


@pytest.mark.parametrize("what", ["tool_calls", "commands"])
def test_a_request_sent_again_with_its_key_answers_the_first_job(stack, run_id, what):
    name = f"keyed-{what}"
    body = append(name) if what == "commands" else {"name": "shell_exec", "arguments": {"id": "main", **append(name)}}
    jobs = {post(stack, run_id, what, body, key=f"k-{what}").json()["job_id"] for _ in range(3)}
    assert len(jobs) == 1, jobs
    assert finished(stack, jobs.pop())["state"] == "succeeded"
    again = post(stack, run_id, what, body, key=f"k-{what}")  # after the job ended: still its job
    assert again.status_code == 202 and finished(stack, again.json()["job_id"])["state"] == "succeeded"
    other = post(stack, run_id, what, body, key=f"k2-{what}")  # another key: another job
    assert finished(stack, other.json()["job_id"])["state"] == "succeeded"
    assert lines(stack, run_id).count(name) == 2


def test_an_evaluation_and_a_fork_sent_again_with_their_key_run_once(stack, run_id):
    store = Store(stack.redis)
    evaluations = {post(stack, run_id, "evaluation", key="k-eval").json()["job_id"] for _ in range(2)}
    assert len(evaluations) == 1
    assert finished(stack, evaluations.pop())["state"] == "succeeded"
    replies = [post(stack, run_id, "fork", {"count": 1}, key="k-fork").json() for _ in range(2)]
    assert replies[0] == replies[1] and len(replies[0]["run_ids"]) == 1, replies
    assert finished(stack, replies[0]["job_id"])["state"] == "succeeded"
    kinds = [job["kind"] for job in store.get_jobs(store.run_jobs(run_id))]
    assert kinds.count("evaluation") == 1 and kinds.count("fork") == 1
    requests.delete(f"{stack.url}/v1/runs/{replies[0]['run_ids'][0]}", timeout=30)


def test_a_refused_request_lets_its_key_go_and_a_bad_key_is_refused(stack):
    """A request refused before anything is queued holds no key: sent again once the run can
    take it, it queues its job. A key that is not printable ASCII, or too long, is a 400."""
    started = submit(stack, "hello-file")
    run_id = started["run_id"]
    early = post(stack, run_id, "commands", append("late"), key="k-late")
    if early.status_code == 409:  # not started yet: refused, nothing queued
        assert finished(stack, started["job_id"])["state"] == "succeeded"
    else:
        assert early.status_code == 202, early.text
    finished(stack, started["job_id"])
    time.sleep(0.1)
    reply = post(stack, run_id, "commands", append("late"), key="k-late")
    assert reply.status_code == 202 and finished(stack, reply.json()["job_id"])["state"] == "succeeded"
    for bad in ("x" * 257, "caf\u00e9"):
        refused = requests.post(
            f"{stack.url}/v1/runs/{run_id}/commands",
            json=append("bad"),
            headers={"Idempotency-Key": bad.encode("utf-8").decode("latin-1")},
            timeout=30,
        )
        assert_error(refused, 400, "Idempotency-Key", code="BAD_REQUEST")
    assert lines(stack, run_id).count("late") == 1 and "bad" not in lines(stack, run_id)
    requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=30)
