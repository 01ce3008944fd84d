"""The runs API (/v1): submit and poll, one-shot episodes, both faces on one store, errors,
and the OpenAPI document. Runs against the session's real stack (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import requests

from app import BROWSER_PAGES, create_app, stop_app
from devstack import ROOT
from tests.conftest import wait_for

ENDED = ("succeeded", "failed")


# ---- helpers --------------------------------------------------------------------------------
def meta(task: str) -> dict:
    return {"task_name": task, "task_path": task, "instruction": f"solve {task}"}


def submit(stack, task: str, **extra) -> dict:
    reply = stack.post("/v1/runs", {"task_meta": meta(task), **extra})
    assert reply.status_code == 202, reply.text
    body = reply.json()
    assert body["ok"] is True and body["run_id"].startswith("run-"), body
    return body


def get_job(stack, job_id: str, wait: float | None = None) -> dict:
    reply = stack.get(f"/v1/jobs/{job_id}" + ("" if wait is None else f"?wait={wait}"), timeout=90)
    assert reply.status_code == 200, reply.text
    return reply.json()["job"]


def finished(stack, job_id: str, limit: float = 240) -> dict:
    """Long-poll until the job has ended (several ?wait rounds for a slow build)."""
    deadline = time.monotonic() + limit
    job = get_job(stack, job_id, wait=60)
    while job["state"] not in ENDED and time.monotonic() < deadline:
        job = get_job(stack, job_id, wait=60)
    assert job["state"] in ENDED, job
    return job


def get_run(stack, run_id: str) -> dict:
    reply = stack.get(f"/v1/runs/{run_id}")
    assert reply.status_code == 200, reply.text
    return reply.json()["run"]


def tool_call(stack, run_id: str, name: str, **arguments) -> str:
    return post_call(stack, run_id, {"name": name, "arguments": arguments})


def post_call(stack, run_id: str, call: dict) -> str:
    reply = stack.post(f"/v1/runs/{run_id}/tool_calls", call)
    assert reply.status_code == 202, reply.text
    return reply.json()["job_id"]


def solution_script(task: str) -> list[dict]:
    """The reference solution as tool calls, the way an agent would apply it."""
    script = (ROOT / "tests" / "fixtures" / "tasks" / task / "solution.sh").read_text()
    return [
        {"name": "shell_write_content_to_file", "arguments": {"content": script, "file_path": "/tmp/solution.sh"}},
        {"name": "shell_exec", "arguments": {"id": "main", "command": "bash /tmp/solution.sh", "block": True}},
    ]


def delete(stack, run_id: str) -> requests.Response:
    return requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=30)


def assert_error(reply, status: int, text: str = "", code: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json()
    assert body["ok"] is False and text in body["error"], body
    if code:
        assert body.get("code") == code, body
    return body


def assert_times_ordered(jobs: list[dict]) -> None:
    for job in jobs:
        assert job["queued_at"] <= job["started_at"] <= job["finished_at"], job


def no_containers(docker_client, run_id: str) -> bool:
    # ignore_removed: a container the teardown removes while it is being listed is gone, not an error
    return not docker_client.containers.list(all=True, filters={"label": f"termpool.run={run_id}"}, ignore_removed=True)


def live_keys(stack) -> dict:
    return stack.get("/status").json()["pool"]["tasks"]


# ---- submit and poll --------------------------------------------------------------------------
def test_submit_and_poll_episode(stack, docker_client):
    request_id = uuid.uuid4().hex
    # The lifecycle worker held still while the run is starting: a start from the warm pool
    # ends within milliseconds, sooner than the requests below would reach the facade.
    lifecycle = stack.procs["lifecycle"].pid
    os.killpg(lifecycle, signal.SIGSTOP)
    try:
        sub = submit(stack, "hello-file", request_id=request_id)
        run_id, start_id = sub["run_id"], sub["job_id"]
        assert sub["state"] == "starting" and sub["reused"] is False
        assert sub["jobs"] == {"start": start_id, "tool_calls": [], "evaluation": None, "close": None}

        # Before the start has ended the run takes no tool call: 409, not a job that races the start.
        assert_error(
            stack.post(f"/v1/runs/{run_id}/tool_calls", {"name": "shell_view", "arguments": {"id": "x"}}),
            409,
            "starting",
            "RUN_NOT_READY",
        )
        assert_error(stack.post(f"/v1/runs/{run_id}/evaluation"), 409, "starting", "RUN_NOT_READY")
    finally:
        os.killpg(lifecycle, signal.SIGCONT)
    again = stack.post("/v1/runs", {"task_meta": meta("hello-file"), "request_id": request_id}).json()
    assert (again["run_id"], again["job_id"], again["reused"]) == (run_id, start_id, True)

    start = finished(stack, start_id)
    assert start["state"] == "succeeded" and start["kind"] == "start" and start["run_id"] == run_id, start
    assert (start["code"], start["retryable"], start["attempts"]) == (None, None, 1), start
    assert start["result"]["user_msg"] == "Task name:hello-file\nTask instruction: solve hello-file"
    assert start["result"]["tool_schemas"][0]["function"]["name"] == "shell_exec"

    solution = solution_script("hello-file")
    write = finished(stack, post_call(stack, run_id, solution[0]))
    assert write["state"] == "succeeded" and write["result"].startswith("Content successfully written"), write

    # ?wait holds the request while the job runs and answers as soon as it ends.
    slow_id = tool_call(
        stack, run_id, "shell_exec", id="main", block=True, command="sleep 2; bash /tmp/solution.sh; cat /app/hello.txt"
    )
    # (Margins are loose: other developers load this machine; a 5 s poll or a full wait still fails.)
    asked = time.time()
    assert get_job(stack, slow_id, wait=0)["state"] in ("queued", "running"), "wait=0 must not hold the request"
    slow = get_job(stack, slow_id, wait=30)
    answered = time.time()
    assert slow["state"] == "succeeded" and slow["result"].strip() == "Hello, world!", slow
    assert answered - asked >= 1.5, "the reply came before the job could have ended"
    assert answered - slow["finished_at"] < 2.5, "the reply lagged the job's end"
    assert answered - asked < 15, "wait held the request well past the job's end"

    evaluation = finished(stack, stack.post(f"/v1/runs/{run_id}/evaluation").json()["job_id"])
    assert evaluation["state"] == "succeeded", evaluation
    assert evaluation["result"]["score"] == 1.0 and set(evaluation["result"]["tests"].values()) == {"passed"}

    run = get_run(stack, run_id)
    assert run["state"] == "evaluated" and run["score"] == 1.0 and run["error"] is None
    assert run["tests"] == evaluation["result"]["tests"]
    assert (run["task_key"], run["host"]) == ("hello-file", stack.host_id)
    assert run["created_at"] <= run["last_used_at"]
    assert run["user_msg"] == start["result"]["user_msg"] and run["tool_schemas"] == start["result"]["tool_schemas"]
    assert run["jobs"] == [start_id, write["job_id"], slow_id, evaluation["job_id"]]
    jobs = [start, write, slow, evaluation]
    assert_times_ordered(jobs)
    for before, after in zip(jobs, jobs[1:]):
        assert before["finished_at"] <= after["queued_at"]

    closing = delete(stack, run_id)
    assert closing.status_code == 202, closing.text
    close_id = closing.json()["job_id"]
    assert closing.json() == {"ok": True, "job_id": close_id, "found": True}
    assert finished(stack, close_id)["state"] == "succeeded"
    assert no_containers(docker_client, run_id)
    assert get_run(stack, run_id)["state"] == "closed"

    # A second DELETE is harmless: 200, found false, and the close job to wait on.
    repeat = delete(stack, run_id)
    assert repeat.status_code == 200, repeat.text
    assert repeat.json() == {"ok": True, "job_id": close_id, "found": False, "state": "closed"}
    assert_error(stack.post(f"/v1/runs/{run_id}/tool_calls", {"name": "shell_view"}), 409, "closed", "RUN_CLOSED")
    assert_error(stack.post(f"/v1/runs/{run_id}/evaluation"), 409, "closed", "RUN_CLOSED")
    assert get_run(stack, run_id)["score"] == 1.0, "a closed run keeps its result"


# ---- both faces, one store --------------------------------------------------------------------
def test_pool_lease_is_a_run(stack, router, docker_client):
    lease = router.allocate("hello-file")
    allocated = get_run(stack, lease)
    assert allocated["state"] == "allocated"
    assert get_run(stack, lease)["last_used_at"] > allocated["last_used_at"], "reading a run counts as using it"
    assert_error(stack.post(f"/v1/runs/{lease}/tool_calls", {"name": "shell_view"}), 409, "allocated", "RUN_NOT_READY")
    reset = router.reset(lease, "hello-file")
    assert reset.status_code == 200, reset.text

    run = get_run(stack, lease)
    assert run["state"] == "ready" and run["user_msg"] == reset.json()["user_msg"]
    assert len(run["jobs"]) == 1
    start = get_job(stack, run["jobs"][0])
    assert (start["kind"], start["state"], start["run_id"]) == ("start", "succeeded", lease)

    echo = finished(stack, tool_call(stack, lease, "shell_exec", id="main", command="echo across-faces"))
    assert "across-faces" in echo["result"], echo
    assert router.close(lease) == {"ok": True, "found": True}
    run = get_run(stack, lease)
    assert run["state"] in ("closing", "closed") and len(run["jobs"]) == 3
    assert get_job(stack, run["jobs"][-1])["kind"] == "close"
    assert wait_for(lambda: no_containers(docker_client, lease), 60)


def test_submitted_run_driven_by_pool_api(stack, router, docker_client):
    """evaluate/close false: the script runs, then the run stays open for the pool API."""
    sub = submit(stack, "hello-file", script=solution_script("hello-file"), evaluate=False, close=False)
    run_id = sub["run_id"]
    assert sub["jobs"]["evaluation"] is None and sub["jobs"]["close"] is None
    last = finished(stack, sub["jobs"]["tool_calls"][-1])
    assert last["state"] == "succeeded", last
    run = get_run(stack, run_id)
    assert run["state"] == "ready" and run["score"] is None

    assert router.sh(run_id, "cat /app/hello.txt").strip() == "Hello, world!"
    reply = router.evaluate(run_id)
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    run = get_run(stack, run_id)
    assert run["state"] == "evaluated" and run["score"] == 1.0
    kinds = [get_job(stack, job_id)["kind"] for job_id in run["jobs"]]
    assert kinds == ["start", "tool_call", "tool_call", "tool_call", "evaluation"]
    assert router.close(run_id) == {"ok": True, "found": True}
    assert wait_for(lambda: no_containers(docker_client, run_id), 60)


# ---- one-shot episodes ------------------------------------------------------------------------
def test_one_shot_episode_scores_and_closes(stack, docker_client):
    sub = submit(
        stack, "hello-file", task_key="oneshot-hello", script=solution_script("hello-file"), evaluate=True, close=True
    )
    run_id, steps = sub["run_id"], sub["jobs"]
    order = [steps["start"], *steps["tool_calls"], steps["evaluation"], steps["close"]]
    assert len(order) == 5 and sub["job_id"] == steps["start"]
    close = finished(stack, steps["close"])
    assert close["state"] == "succeeded", close

    run = get_run(stack, run_id)
    assert run["state"] == "closed" and run["task_key"] == "oneshot-hello"
    assert run["score"] == 1.0 and run["error"] is None
    assert run["tests"] and set(run["tests"].values()) == {"passed"}
    assert run["jobs"] == order
    jobs = [get_job(stack, job_id) for job_id in order]
    assert [j["kind"] for j in jobs] == ["start", "tool_call", "tool_call", "evaluation", "close"]
    assert all(j["state"] == "succeeded" for j in jobs), jobs
    assert jobs[3]["result"] == {"score": 1.0, "tests": run["tests"]}
    assert_times_ordered(jobs)
    for before, after in zip(jobs, jobs[1:]):
        assert before["finished_at"] <= after["started_at"], "chain steps overlapped"
    assert no_containers(docker_client, run_id)
    assert "oneshot-hello" not in live_keys(stack), "the episode kept its capacity slot"


@pytest.mark.parametrize("close", [True, False])
def test_one_shot_episode_with_failing_start(stack, docker_client, close):
    key = f"oneshot-broken-{close}"
    sub = submit(
        stack,
        "broken-dockerfile",
        task_key=key,
        evaluate=True,
        close=close,
        script=[{"name": "shell_exec", "arguments": {"id": "main", "command": "echo never"}}] * 2,
    )
    run_id, steps = sub["run_id"], sub["jobs"]
    start = finished(stack, steps["start"])
    assert start["state"] == "failed" and "fail" in start["error"].lower(), start
    assert (start["code"], start["retryable"], start["attempts"]) == ("TASK_BUILD_FAILED", False, 1), start
    skipped = [finished(stack, job_id, limit=30) for job_id in [*steps["tool_calls"], steps["evaluation"]]]
    for job in skipped:
        assert job["state"] == "failed" and job["error"].startswith("skipped:") and start["job_id"] in job["error"]
        assert job["started_at"] is None and job["code"] == "TASK_BUILD_FAILED"
    run = get_run(stack, run_id)
    assert run["error"] and run["score"] is None
    assert run["code"] == "TASK_BUILD_FAILED" and run["error"] == start["error"], run
    if close:
        # The close step still runs (the failure handler sends it): it ends the episode.
        assert finished(stack, steps["close"])["state"] == "succeeded"
        assert get_run(stack, run_id)["state"] == "closed"
    else:
        assert steps["close"] is None and run["state"] == "failed"
        assert key in live_keys(stack), "without close the failed run stays leased"
        reply = delete(stack, run_id)
        assert reply.status_code == 202, reply.text
        assert finished(stack, reply.json()["job_id"])["state"] == "succeeded"
    assert no_containers(docker_client, run_id)
    assert key not in live_keys(stack)
    states = {get_job(stack, job_id)["state"] for job_id in get_run(stack, run_id)["jobs"]}
    assert not states & {"queued", "running"}, "a job was left hanging"


# ---- errors ----------------------------------------------------------------------------------
def test_unknown_ids_are_404(stack):
    missing = "run-0000000000000000"
    assert_error(stack.get(f"/v1/runs/{missing}"), 404, missing, "UNKNOWN_RUN")
    assert_error(delete(stack, missing), 404, missing, "UNKNOWN_RUN")
    assert_error(stack.post(f"/v1/runs/{missing}/tool_calls", {"name": "shell_view"}), 404, missing, "UNKNOWN_RUN")
    assert_error(stack.post(f"/v1/runs/{missing}/evaluation"), 404, missing, "UNKNOWN_RUN")
    asked = time.monotonic()
    assert_error(stack.get("/v1/jobs/no-such-job?wait=20"), 404, "no-such-job", "UNKNOWN_JOB")
    assert time.monotonic() - asked < 10, "an unknown job must not be waited for"
    assert_error(stack.get("/v1/nope"), 404)
    assert_error(stack.post(f"/v1/runs/{missing}"), 405)


@pytest.mark.parametrize(
    "body, text",
    [
        ({}, "task_meta must be a dict"),
        ({"task_meta": {"task_name": "x", "task_path": "../../etc"}}, "task_meta.task_path"),
        ({"task_meta": meta("hello-file"), "script": ["shell_view"]}, "script[0]: tool_call must be a dict"),
        ({"task_meta": meta("hello-file"), "close": 1}, "close must be true or false"),
    ],
)
def test_bad_run_bodies_are_400_and_take_no_slot(stack, body, text):
    before = stack.get("/status").json()["pool"]["total_active_runs"]
    assert_error(stack.post("/v1/runs", body), 400, text)
    assert stack.get("/status").json()["pool"]["total_active_runs"] == before


def test_bad_tool_call_bodies_and_wait_values_are_400(stack, router):
    lease = router.allocate("hello-file")  # never started: the body is checked first, so 400 not 409
    path = f"/v1/runs/{lease}/tool_calls"
    assert_error(
        requests.post(stack.url + path, data="[1]", headers={"Content-Type": "application/json"}, timeout=30),
        400,
        "tool_call.name",
    )
    assert_error(stack.post(path, {"name": ""}), 400, "tool_call.name must be a non-empty string")
    assert_error(stack.post(path, {"name": "shell_view", "arguments": "id=main"}), 400, "arguments must be a dict")

    closing = delete(stack, lease)
    assert closing.status_code == 202, closing.text
    job_id = closing.json()["job_id"]
    for value in ("abc", "-1", "61", "nan", "inf", "", "1e9"):
        assert_error(stack.get(f"/v1/jobs/{job_id}?wait={value}"), 400, "wait must be a number")
    assert finished(stack, job_id)["state"] == "succeeded"
    asked = time.monotonic()
    assert get_job(stack, job_id, wait=60)["state"] == "succeeded"
    assert time.monotonic() - asked < 10, "an ended job must be answered at once, not after the wait"


def test_capacity_is_429_like_allocate(stack, router):
    leases = [router.allocate("cap-runs-api") for _ in range(8)]
    try:
        body = assert_error(
            stack.post("/v1/runs", {"task_meta": meta("hello-file"), "task_key": "cap-runs-api"}),
            429,
            "WORKER_MAX_RUNS_PER_TASK",
            "RUN_SLOTS_EXHAUSTED",
        )
        assert "cap-runs-api" in body["error"]
        assert live_keys(stack)["cap-runs-api"] == {"active_runs": 8}
    finally:
        for lease in leases:
            router.close(lease)


# ---- the API document --------------------------------------------------------------------------
EXPECTED_PATHS = {
    "/healthz": {"get"},
    "/readyz": {"get"},
    "/status": {"get"},
    "/allocate": {"post"},
    "/heartbeat": {"post"},
    "/reset": {"post"},
    "/exec_tool": {"post"},
    "/evaluate": {"post"},
    "/close": {"post"},
    "/fork": {"post"},
    "/v1/runs": {"post"},
    "/v1/runs/{run_id}": {"get", "delete"},
    "/v1/runs/{run_id}/tool_calls": {"post"},
    "/v1/runs/{run_id}/evaluation": {"post"},
    "/v1/runs/{run_id}/fork": {"post"},
    "/v1/tasks": {"post"},
    "/v1/runs/{run_id}/commands": {"post"},
    "/v1/jobs/{job_id}": {"get", "delete"},
    "/v1/runs/{run_id}/archive": {"put"},
    "/v1/runs/{run_id}/archive/export": {"post"},
    "/v1/jobs/{job_id}/archive": {"get"},
    "/openapi.json": {"get"},
    "/metrics": {"get"},
}


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _served_routes() -> dict:
    """Every route of the two JSON faces, in OpenAPI's path syntax (the browser's pages, the
    run viewer and the pool dashboard, are not an API)."""
    routes: dict = {}
    app = create_app()
    stop_app(app)  # only its routes are read
    for rule in app.url_map.iter_rules():
        if rule.endpoint.partition(".")[0] in BROWSER_PAGES:
            continue
        path = rule.rule.replace("<", "{").replace(">", "}")
        routes.setdefault(path, set()).update(m.lower() for m in rule.methods - {"HEAD", "OPTIONS"})
    return routes


def test_openapi_document_lists_every_path(stack):
    reply = stack.get("/openapi.json")
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("application/json")
    doc = reply.json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"]
    documented = {path: set(ops) for path, ops in doc["paths"].items()}
    assert documented == EXPECTED_PATHS
    assert documented == _served_routes(), "a served route is missing from (or extra in) /openapi.json"
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"], (path, method)
            for name in (p[1:-1] for p in path.split("/") if p.startswith("{")):
                assert name in {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}, (path, name)
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    assert "429" in doc["paths"]["/v1/runs"]["post"]["responses"]
    assert "409" in doc["paths"]["/v1/runs/{run_id}/tool_calls"]["post"]["responses"]
