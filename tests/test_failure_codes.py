"""Failure codes on every failed job and reply, and automatic retries of transient Docker
failures, injected by a proxy in front of the real dockerd (tests/docker_fault_proxy.py)."""

from __future__ import annotations

import re
import time

import docker.errors
import pytest
import requests

from app import error_codes
from devstack import ROOT
from environments.tools.texts import NO_OUTPUT
from poolcore import failures
from poolcore.state import PREFIX
from tests.conftest import Router, proxied_stack, wait_for
from tests.test_metrics import scrape, value
from tests.test_runs_api import finished, get_run, solution_script, submit, tool_call


# ---- the table and its statuses (no Docker) ---------------------------------------------------
@pytest.mark.unit
def test_every_code_has_a_status_on_each_face():
    rows = {row["code"]: row for row in error_codes.rows()}
    assert list(rows) == list(failures.CODES)
    for code, row in rows.items():
        assert row["pool_status"] or row["runs_status"] or row["in_job_records"], code
        if failures.CODES[code].kind != "client":
            assert error_codes.pool_status(code) in (500, 503), code
            assert row["in_job_records"] == (code not in error_codes.PROBE_CODES), code
    unavailable = "BACKEND_UNAVAILABLE REDIS_UNAVAILABLE BACKEND_FULL HOST_LOST CONTAINER_LOST WORKERS_DOWN NOT_READY"
    assert {c for c in rows if error_codes.pool_status(c) == 503} == set(unavailable.split())
    assert error_codes.pool_status("UNKNOWN_LEASE") == 500 and error_codes.runs_status("UNKNOWN_RUN") == 404
    assert error_codes.pool_status("RUN_SLOTS_EXHAUSTED") == 429


@pytest.mark.unit
def test_rendered_table_lists_every_code_once():
    table = error_codes.render_table()
    body = [line for line in table.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `(\w+)`", line).group(1) for line in body] == list(failures.CODES)
    assert "| `TESTS_TIMEOUT` | task | no | 500 | job record |" in table
    assert "| `BACKEND_UNAVAILABLE` | infrastructure | yes | 503 | 503, job record |" in table


@pytest.mark.unit
def test_documented_table_matches_the_codes():
    """docs/http-api.md holds the table `python -m app.error_codes` prints, exactly once."""
    page = (ROOT / "docs" / "http-api.md").read_text()
    assert page.count(error_codes.TABLE_BEGIN) == 1, "docs/http-api.md must hold the failure-code table once"
    start = page.index(error_codes.TABLE_BEGIN)
    end = page.index(error_codes.TABLE_END, start) + len(error_codes.TABLE_END)
    assert page[start:end] + "\n" == error_codes.render_table(), "run python -m app.error_codes"


@pytest.mark.unit
def test_error_texts_are_capped():
    text = "head " + "x" * 50_000 + " the cause at the end"
    cut = failures.cap(text)
    assert len(cut) == failures.ERROR_LIMIT
    assert cut.startswith("head ") and cut.endswith("the cause at the end") and "characters cut" in cut
    assert failures.cap("short") == "short"


@pytest.mark.unit
def test_only_transient_docker_failures_are_retried():
    from tasks.job_context import transient

    assert transient(docker.errors.APIError("boom", response=_response(500)))
    assert transient(docker.errors.APIError("busy", response=_response(503)))
    assert not transient(docker.errors.APIError("conflict", response=_response(409)))
    assert not transient(docker.errors.ImageNotFound("gone", response=_response(404)))
    assert transient(ConnectionResetError()) and transient(requests.exceptions.ConnectionError())
    assert transient(requests.exceptions.ReadTimeout())
    assert not transient(TimeoutError("our own limit: the budget is spent"))
    for task_error in (failures.TaskBuildFailed, failures.TaskStartFailed, failures.TestsTimeout):
        assert not transient(task_error("broken task"))
    assert transient(failures.DockerError("engine 500"))
    assert not transient(ValueError("a bug"))


@pytest.mark.unit
def test_dockers_not_running_answer_is_taken_as_it_is():
    """An exec refused because the container stopped is the container lost, whatever an inspect
    a moment later says (right after a daemon restart it may still say running)."""
    from environments.docker_client import says_not_running

    stopped = "Container 09ff2d3e is not running"
    assert says_not_running(docker.errors.APIError("409", response=_response(409), explanation=stopped))
    assert not says_not_running(docker.errors.APIError("409", response=_response(409), explanation="is paused"))
    assert not says_not_running(docker.errors.APIError("500", response=_response(500), explanation=stopped))
    assert not says_not_running(RuntimeError(stopped))


def _response(status: int) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    return response


# ---- task errors end to end on the session stack ------------------------------------------------
def job(stack, job_id: str) -> dict:
    return stack.get(f"/v1/jobs/{job_id}").json()["job"]


def failures_by_code(stack) -> dict:
    samples = scrape(stack)
    return {code: value(samples, "termpool_job_failures_total", code=code) for code in failures.CODES}


def test_build_failure_is_a_task_error_on_both_faces(stack, router, docker_client):
    before = failures_by_code(stack)
    lease = router.allocate("broken-dockerfile")
    reply = router.reset(lease, "broken-dockerfile")
    assert reply.status_code == 500, reply.text
    body = reply.json()
    assert body["ok"] is False and body["code"] == "TASK_BUILD_FAILED" and body["retryable"] is False, body
    assert "exit 3" in body["error"] and len(body["error"]) <= failures.ERROR_LIMIT
    run = get_run(stack, lease)
    assert run["state"] == "failed" and run["code"] == "TASK_BUILD_FAILED" and run["retryable"] is False
    start = job(stack, run["jobs"][0])
    assert (start["state"], start["code"], start["retryable"], start["attempts"]) == (
        "failed",
        "TASK_BUILD_FAILED",
        False,
        1,
    ), start
    router.close(lease)

    sub = submit(stack, "broken-dockerfile", evaluate=True, close=True, script=solution_script("broken-dockerfile"))
    start = finished(stack, sub["jobs"]["start"])
    assert (start["code"], start["retryable"], start["attempts"]) == ("TASK_BUILD_FAILED", False, 1), start
    for job_id in [*sub["jobs"]["tool_calls"], sub["jobs"]["evaluation"]]:
        skipped = finished(stack, job_id, limit=60)
        assert skipped["error"].startswith("skipped:") and skipped["code"] == "TASK_BUILD_FAILED", skipped
    assert finished(stack, sub["jobs"]["close"])["state"] == "succeeded"
    run = get_run(stack, sub["run_id"])
    assert run["code"] == "TASK_BUILD_FAILED" and "exit 3" in run["error"], run
    assert wait_for(lambda: not router.run_containers(docker_client, sub["run_id"]), 60)
    # Two failed starts counted; the three skipped steps are not failures of their own.
    after = failures_by_code(stack)
    assert after["TASK_BUILD_FAILED"] - before["TASK_BUILD_FAILED"] == 2
    assert after["INTERNAL"] == before["INTERNAL"]


def test_slow_tests_time_out_on_both_faces(stack, router):
    before = failures_by_code(stack)
    lease = router.allocate("slow-tests")
    assert router.reset(lease, "slow-tests").status_code == 200
    reply = router.evaluate(lease)
    assert reply.status_code == 500, reply.text
    body = reply.json()
    assert (body["code"], body["retryable"]) == ("TESTS_TIMEOUT", False) and "timed out" in body["error"], body
    run = get_run(stack, lease)
    assert run["state"] == "ready" and run["code"] == "TESTS_TIMEOUT", run
    evaluation = job(stack, run["jobs"][-1])
    assert (evaluation["kind"], evaluation["code"], evaluation["attempts"]) == ("evaluation", "TESTS_TIMEOUT", 1)
    router.close(lease)

    sub = submit(stack, "slow-tests", evaluate=True, close=True, script=solution_script("slow-tests"))
    evaluation = finished(stack, sub["jobs"]["evaluation"])
    assert (evaluation["state"], evaluation["code"], evaluation["retryable"]) == ("failed", "TESTS_TIMEOUT", False)
    assert finished(stack, sub["jobs"]["close"])["state"] == "succeeded"
    run = get_run(stack, sub["run_id"])
    assert run["state"] == "closed" and run["code"] == "TESTS_TIMEOUT" and run["score"] is None, run
    assert failures_by_code(stack)["TESTS_TIMEOUT"] - before["TESTS_TIMEOUT"] == 2


def test_client_errors_carry_codes(stack, router):
    reply = stack.post("/heartbeat", {"lease_id": "run-0000000000000000"})
    assert reply.status_code == 500
    assert reply.json() == {
        "ok": False,
        "error": "Unknown run_lease_id: run-0000000000000000",
        "code": "UNKNOWN_LEASE",
        "retryable": False,
    }
    lease = router.allocate("hello-file")
    reply = stack.post("/evaluate", {"lease_id": lease})
    assert reply.status_code == 500 and reply.json()["code"] == "RUN_NOT_READY", reply.text
    reply = stack.post(f"/v1/runs/{lease}/evaluation")
    assert reply.status_code == 409 and reply.json()["code"] == "RUN_NOT_READY" and reply.json()["retryable"] is False
    router.close(lease)
    reply = stack.get("/v1/runs/run-0000000000000000")
    assert reply.status_code == 404 and reply.json()["code"] == "UNKNOWN_RUN" and reply.json()["retryable"] is False


# ---- automatic retries through the fault proxy --------------------------------------------------
@pytest.fixture(scope="module")
def proxied(base_image, docker_client):
    """A stack whose workers reach dockerd only through the fault proxy."""
    # The warm pool off: the tests count the Docker calls of one run (no spares beside it).
    env = {"WARM_POOL_SIZE": "0", "ARCHIVE_READ_TIMEOUT": str(ARCHIVE_DEADLINE)}
    yield from proxied_stack(docker_client, env)


CONTAINER = r"/containers/[^/]+"
ARCHIVE_DEADLINE = 5  # ARCHIVE_READ_TIMEOUT of the proxied stack


def retries(stack, task: str) -> float:
    return value(scrape(stack), "termpool_job_retries_total", task=task, reason="DOCKER_ERROR")


def test_transient_docker_errors_are_retried(proxied, docker_client):
    stack, proxy = proxied
    # Start: the image check fails once, container create twice.
    proxy.fail("GET", r"/images/[^/]+/json", 1)
    proxy.fail("POST", r"/containers/create", 2)
    sub = submit(stack, "hello-file")
    run_id = sub["run_id"]
    start = finished(stack, sub["job_id"])
    assert start["state"] == "succeeded" and start["attempts"] == 4 and start["code"] is None, start
    assert len(proxy.injected) == 3
    assert len(docker_client.containers.list(all=True, filters={"label": f"termpool.run={run_id}"})) == 1, (
        "a half-made container was left by a failed attempt"
    )

    for call in solution_script("hello-file"):
        reply = stack.post(f"/v1/runs/{run_id}/tool_calls", call)
        assert finished(stack, reply.json()["job_id"])["state"] == "succeeded"

    # Evaluation: copying the tests in fails once (before they start): retried.
    proxy.fail("PUT", CONTAINER + "/archive", 1)
    evaluation = finished(stack, stack.post(f"/v1/runs/{run_id}/evaluation").json()["job_id"])
    assert evaluation["state"] == "succeeded" and evaluation["attempts"] == 2, evaluation
    assert evaluation["result"]["score"] == 1.0

    # Teardown: removing the container fails once: retried, nothing left.
    proxy.fail("DELETE", CONTAINER, 1)
    close_id = requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=30).json()["job_id"]
    close = finished(stack, close_id)
    assert close["state"] == "succeeded" and close["attempts"] == 2 and close["result"]["containers_removed"] == 1
    assert not docker_client.containers.list(all=True, filters={"label": f"termpool.run={run_id}"})
    assert len(proxy.injected) == 5

    samples = scrape(stack)
    for task, n in (("pool.ensure_image", 1), ("pool.start_run", 2), ("pool.evaluate", 1), ("pool.close_run", 1)):
        assert value(samples, "termpool_job_retries_total", task=task, reason="DOCKER_ERROR") == n, task
    assert value(samples, "termpool_job_failures_total", code="DOCKER_ERROR") == 0


def test_tests_are_never_run_twice(proxied):
    """A Docker error once the tests have started fails the evaluation (retryable for the
    trainer) instead of running the task's tests again."""
    stack, proxy = proxied
    router = Router(stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    # The reset answers before the tool server's own exec runs (in the background): a tool call
    # waits for that server, so its exec is counted before the evaluation's.
    assert router.sh(lease, "true") == NO_OUTPUT
    before = proxy.count("POST", CONTAINER + "/exec")
    retried = retries(stack, "pool.evaluate")
    failed = value(scrape(stack), "termpool_job_failures_total", code="DOCKER_ERROR")
    proxy.fail("POST", CONTAINER + "/exec", 1)
    reply = router.evaluate(lease)
    assert reply.status_code == 500, reply.text
    assert (reply.json()["code"], reply.json()["retryable"]) == ("DOCKER_ERROR", True), reply.text
    assert proxy.count("POST", CONTAINER + "/exec") == before + 1, "the tests were started again"
    run = get_run(stack, lease)
    assert run["state"] == "ready" and run["code"] == "DOCKER_ERROR"
    assert requests.get(f"{stack.url}/v1/jobs/{run['jobs'][-1]}", timeout=30).json()["job"]["attempts"] == 1
    assert retries(stack, "pool.evaluate") == retried
    assert value(scrape(stack), "termpool_job_failures_total", code="DOCKER_ERROR") == failed + 1
    router.close(lease)


def test_a_task_error_is_not_retried(proxied):
    stack, proxy = proxied
    retried = retries(stack, "pool.ensure_image")
    sub = submit(stack, "broken-dockerfile", close=True)
    start = finished(stack, sub["job_id"])
    assert (start["state"], start["attempts"], start["retryable"]) == ("failed", 1, False), start
    assert start["code"] == "TASK_BUILD_FAILED", start
    assert retries(stack, "pool.ensure_image") == retried


def test_compose_tasks_go_through_the_proxy(proxied):
    """The compose CLI reads DOCKER_HOST too: a two-service task starts and scores through it."""
    stack, proxy = proxied
    sub = submit(stack, "sidecar-kv", evaluate=True, close=True, script=solution_script("sidecar-kv"))
    close = finished(stack, sub["jobs"]["close"], limit=400)
    assert close["state"] == "succeeded", close
    assert get_run(stack, sub["run_id"])["score"] == 1.0
    assert any(path.startswith("/containers/create") for _, path in proxy.requests)


def test_a_stalled_archive_stream_fails_at_its_deadline(proxied):
    """dockerd's tar stream of an export stops midway (the proxy holds the rest, the connection
    open): the job fails TIMEOUT at ARCHIVE_READ_TIMEOUT instead of holding an exec thread
    until the SDK's 600 s socket timeout (a stream that drips never trips that), keeps no
    archive, and the next export of the same file comes whole."""
    stack, proxy = proxied
    sub = submit(stack, "hello-file")
    run_id = sub["run_id"]
    assert finished(stack, sub["job_id"])["state"] == "succeeded"
    make = tool_call(stack, run_id, "shell_exec", id="m", command="head -c 3000000 /dev/urandom > /tmp/big.bin")
    assert finished(stack, make)["state"] == "succeeded"

    proxy.stall("GET", CONTAINER + "/archive", after_bytes=65536)
    began = time.monotonic()
    job_id = stack.post(f"/v1/runs/{run_id}/archive/export", {"path": "/tmp/big.bin"}).json()["job_id"]
    job = finished(stack, job_id, limit=120)
    took = time.monotonic() - began
    assert (job["state"], job["code"], job["retryable"]) == ("failed", "TIMEOUT", True), job
    assert "ARCHIVE_READ_TIMEOUT" in job["error"]
    assert ARCHIVE_DEADLINE <= took < ARCHIVE_DEADLINE + 30, took
    assert proxy.injected[-1][0] == "GET" and proxy.injected[-1][1].endswith("/archive")
    assert stack.redis.exists(f"{PREFIX}blob:{job_id}") == 0  # nothing of the archive kept

    again = stack.post(f"/v1/runs/{run_id}/archive/export", {"path": "/tmp/big.bin"}).json()["job_id"]
    job = finished(stack, again)
    assert job["state"] == "succeeded" and job["result"]["size"] > 3000000, job
    assert len(stack.get(f"/v1/jobs/{again}/archive").content) == job["result"]["size"]
    assert requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=30).status_code == 202
