"""Two tenants and the operator on one real stack, over HTTP (docs/tenants.md): each tenant's
runs answer another tenant as unknown ones do, byte for byte, on every run operation of both
faces and the viewer; the operator sees both; max_runs is a 429 that takes nothing; a tenant's
reserved slots hold against a flood from the other."""

from __future__ import annotations

import threading

import pytest
import requests

from devstack import FIXTURES
from termpool.client.task_tar import folder_archive
from tests.conftest import private_stack, wait_for

ADMIN = "admin-token-0000"
A, B = "tenant-a-token-1111", "tenant-b-token-2222"
MISSING = "run-0000000000000000"
MISSING_JOB = "00000000-0000-0000-0000-000000000000"
TENANTS = f"""\
tenants:
  team-a:
    token: {A}
    max_runs: 3
    reserved_runs: 2
    priority: eval
  team-b:
    token: {B}
    max_runs: 5
"""


@pytest.fixture(scope="module")
def pool(docker_client, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    env = {
        "POOL_API_TOKEN": ADMIN,
        "TENANTS_FILE": str(path),
        "WORKER_MAX_TASKS": "2",
        "WORKER_MAX_RUNS_PER_TASK": "3",
    }
    yield from private_stack(docker_client, env)


def call(stack, token: str, method: str, path: str, body=None, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
    json_body = {"json": body} if "data" not in kw else {}
    return requests.request(method, stack.url + path, headers=headers, timeout=300, **json_body, **kw)


def allocate(stack, token: str, key: str) -> requests.Response:
    return call(stack, token, "POST", "/allocate", {"task_key": key})


def lease(stack, token: str, key: str) -> str:
    reply = allocate(stack, token, key)
    assert reply.status_code == 200, reply.text
    return reply.json()["lease_id"]


def close_all(stack, runs: list[str]) -> None:
    for run_id in runs:
        assert call(stack, ADMIN, "POST", "/close", {"lease_id": run_id}).status_code == 200


def meta(task: str) -> dict:
    return {"task_name": task, "task_path": task, "instruction": f"solve {task}"}


# Every run operation of both faces and the viewer: (method, path, body), with {id} the run.
POOL_OPS = [
    ("POST", "/heartbeat", {"lease_id": "{id}"}),
    ("POST", "/reset", {"lease_id": "{id}", "task_meta": meta("hello-file")}),
    ("POST", "/exec_tool", {"lease_id": "{id}", "tool_call": {"name": "shell_view", "arguments": {"id": "main"}}}),
    ("POST", "/evaluate", {"lease_id": "{id}"}),
    ("POST", "/fork", {"lease_id": "{id}", "count": 1}),
    ("POST", "/close", {"lease_id": "{id}"}),
    ("POST", "/fork", {"lease_id": "{id}", "count": 0}),  # refused as malformed, as for an unknown id
    ("POST", "/reset", {"lease_id": "{id}"}),
]
RUN_OPS = [
    ("GET", "/v1/runs/{id}", None),
    ("POST", "/v1/runs/{id}/tool_calls", {"name": "shell_view", "arguments": {"id": "main"}}),
    ("POST", "/v1/runs/{id}/commands", {"command": "true"}),
    ("POST", "/v1/runs/{id}/evaluation", None),
    ("POST", "/v1/runs/{id}/fork", {"count": 1}),
    ("POST", "/v1/runs/{id}/archive/export", {"path": "/tmp"}),
    ("PUT", "/v1/runs/{id}/archive?path=/tmp", None),  # an empty archive: refused before the run is looked up
    ("DELETE", "/v1/runs/{id}", None),
    ("GET", "/ui/runs/{id}", None),
    ("GET", "/ui/runs/{id}/files/x.txt", None),
]
JOB_OPS = [
    ("GET", "/v1/jobs/{id}", None),
    ("GET", "/v1/jobs/{id}?wait=nope", None),
    ("DELETE", "/v1/jobs/{id}", None),
    ("GET", "/v1/jobs/{id}/archive", None),
]


def fill(body, run_id: str):
    if isinstance(body, dict):
        return {k: fill(v, run_id) for k, v in body.items()}
    return run_id if body == "{id}" else body


def same_as_unknown(stack, token: str, op: tuple, theirs: str, missing: str) -> None:
    """The reply to `theirs` is the reply to an id nobody has, with the id swapped in."""
    method, path, body = op
    got = call(stack, token, method, path.format(id=theirs), fill(body, theirs))
    unknown = call(stack, token, method, path.format(id=missing), fill(body, missing))
    assert got.status_code == unknown.status_code, (op, got.text, unknown.text)
    assert got.content == unknown.content.replace(missing.encode(), theirs.encode()), (op, got.text, unknown.text)
    assert got.status_code in (200, 400, 404, 500), (op, got.text)


def test_another_tenants_runs_are_unknown_on_every_operation(pool):
    # A's runs: a pool API lease, reset (so every operation could act on it), and a runs API run
    a_lease = lease(pool, A, "hello-file")
    reset = call(pool, A, "POST", "/reset", {"lease_id": a_lease, "task_meta": meta("hello-file")})
    assert reset.status_code == 200, reset.text
    submitted = call(pool, A, "POST", "/v1/runs", {"task_meta": meta("hello-file")})
    assert submitted.status_code == 202, submitted.text
    a_run, a_job = submitted.json()["run_id"], submitted.json()["job_id"]
    b_lease = ""
    try:
        b_lease = lease(pool, B, "kb")
        for op in POOL_OPS:
            same_as_unknown(pool, B, op, a_lease, MISSING)
        for op in RUN_OPS:
            for theirs in (a_run, a_lease):
                same_as_unknown(pool, B, op, theirs, MISSING)
        for op in JOB_OPS:
            same_as_unknown(pool, B, op, a_job, MISSING_JOB)
        # B's tries did nothing to A's runs: they are live and A's own
        out = call(
            pool,
            A,
            "POST",
            "/exec_tool",
            {"lease_id": a_lease, "tool_call": {"name": "shell_view", "arguments": {"id": "main"}}},
        )
        assert out.status_code == 200, out.text
        assert call(pool, A, "GET", f"/v1/runs/{a_run}").status_code == 200
        # a fork's children count against its tenant's max_runs (A: 2 live of 3), before anything is taken
        for path, body in (("/fork", {"lease_id": a_lease, "count": 2}), (f"/v1/runs/{a_lease}/fork", {"count": 2})):
            refused = call(pool, A, "POST", path, body)
            assert refused.status_code == 429 and refused.json()["code"] == "TENANT_QUOTA_EXCEEDED", refused.text
        assert tenant_live(pool, A) == 2
        # the operator sees both tenants' runs; each tenant its own, in the viewer's list too
        for run_id in (a_lease, a_run, b_lease):
            reply = call(pool, ADMIN, "GET", f"/v1/runs/{run_id}")
            assert reply.status_code == 200 and reply.json()["run"]["run_id"] == run_id
        listed = {who: call(pool, who, "GET", "/ui/").text for who in (A, B, ADMIN)}
        assert a_lease in listed[A] and b_lease not in listed[A]
        assert b_lease in listed[B] and a_lease not in listed[B] and a_run not in listed[B]
        assert all(run_id in listed[ADMIN] for run_id in (a_lease, a_run, b_lease))
        # a tenant signed in to the viewer with its token: its runs only, B's run unknown
        browser = requests.Session()
        login = browser.post(pool.url + "/ui/login", data={"token": A, "next": "/ui/"}, timeout=30)
        assert login.status_code == 200 and a_lease in login.text and b_lease not in login.text
        page, unknown = (browser.get(f"{pool.url}/ui/runs/{run}", timeout=30) for run in (b_lease, MISSING))
        assert page.status_code == unknown.status_code == 404
        assert page.content == unknown.content.replace(MISSING.encode(), b_lease.encode())
        status = {who: call(pool, who, "GET", "/status").json()["pool"] for who in (A, B, ADMIN)}
        assert status[A]["total_active_runs"] == 2 and status[A]["tenant"]["name"] == "team-a"
        assert status[B]["total_active_runs"] == 1 and status[B]["tenant"]["max_runs"] == 5
        assert status[ADMIN]["total_active_runs"] == 3 and "tenant" not in status[ADMIN]
        # a request id is the tenant's own: B's same id is a run of B's
        first = call(pool, A, "POST", "/allocate", {"task_key": "kb", "request_id": "r1"}).json()["lease_id"]
        other = call(pool, B, "POST", "/allocate", {"task_key": "kb", "request_id": "r1"}).json()
        assert other["lease_id"] != first and other["reused"] is False
        close_all(pool, [first, other["lease_id"]])
    finally:
        close_all(pool, [run for run in (a_lease, a_run, b_lease) if run])


def tenant_live(stack, token: str) -> int:
    return call(stack, token, "GET", "/status").json()["pool"]["tenant"]["live_runs"]


def test_max_runs_is_429_before_anything_is_taken(pool):
    held = [lease(pool, A, key) for key in ("q1", "q1", "q2")]  # A's max_runs: 3
    try:
        before = call(pool, ADMIN, "GET", "/status").json()["pool"]
        for reply in (
            allocate(pool, A, "q2"),
            call(pool, A, "POST", "/v1/runs", {"task_meta": meta("hello-file"), "task_key": "q2"}),
        ):
            assert reply.status_code == 429, reply.text
            body = reply.json()
            assert body["code"] == "TENANT_QUOTA_EXCEEDED" and body["retryable"] is True, body
            assert "max_runs" in body["error"]
        after = call(pool, ADMIN, "GET", "/status").json()["pool"]
        assert after["total_active_runs"] == before["total_active_runs"] == 3 and tenant_live(pool, A) == 3
        close_all(pool, held[:1])  # a slot given back is A's to take again
        held[0] = lease(pool, A, "q1")
    finally:
        close_all(pool, held)
    assert wait_for(lambda: tenant_live(pool, A) == 0, 10)


def test_reserved_slots_hold_against_a_flood(pool):
    """The pool holds 6 runs (2 task keys x 3); A reserves 2, so B's flood (its max_runs: 5)
    gets 4 and no more, however many race for them, and A still gets its 2."""
    replies: list[tuple[str, requests.Response]] = []

    def flood(i: int) -> None:
        replies.append((f"f{i % 2}", allocate(pool, B, f"f{i % 2}")))

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    taken = {r.json()["lease_id"]: key for key, r in replies if r.status_code == 200}
    mine: list[str] = []
    try:
        assert len(taken) == 4, [r.text for _, r in replies]
        refused = [r.json() for _, r in replies if r.status_code != 200]
        # a key already full answers as before; the rest is the reservation's refusal
        assert "TENANT_QUOTA_EXCEEDED" in {body["code"] for body in refused}, refused
        assert {body["code"] for body in refused} <= {"TENANT_QUOTA_EXCEEDED", "RUN_SLOTS_EXHAUSTED"}, refused
        assert all("reserved" in b["error"] and b["retryable"] for b in refused if b["code"] == "TENANT_QUOTA_EXCEEDED")
        room = {key: 3 - list(taken.values()).count(key) for key in ("f0", "f1")}
        mine = [lease(pool, A, key) for key, n in room.items() for _ in range(n)]  # A's reservation held
        assert len(mine) == 2 and tenant_live(pool, A) == 2 and tenant_live(pool, B) == 4
    finally:
        close_all(pool, [*taken, *mine])


def test_an_uploaded_task_is_its_uploaders(pool):
    """Another tenant's uploaded task is one never uploaded, until it uploads the same content."""
    body = folder_archive(FIXTURES / "hello-file")
    headers = {"Content-Type": "application/x-tar"}
    first = call(pool, A, "POST", "/v1/tasks", data=body, headers=headers)
    assert first.status_code == 201, first.text
    path, nowhere = first.json()["task_path"], "sha256:" + "0" * 64
    submit = {"task_meta": {**meta("hello-file"), "task_path": path}}
    refused = call(pool, B, "POST", "/v1/runs", submit)
    unknown = call(pool, B, "POST", "/v1/runs", {"task_meta": {**meta("hello-file"), "task_path": nowhere}})
    assert refused.status_code == unknown.status_code == 404 and refused.json()["code"] == "UNKNOWN_TASK"
    assert refused.content == unknown.content.replace(nowhere.encode(), path.encode())
    assert tenant_live(pool, B) == 0  # refused before a slot was taken
    again = call(pool, B, "POST", "/v1/tasks", data=body, headers=headers)  # new to B: created
    assert again.status_code == 201 and again.json()["created"] is True, again.text
    started = call(pool, B, "POST", "/v1/runs", submit)
    assert started.status_code == 202, started.text
    run_id, job_id = started.json()["run_id"], started.json()["job_id"]
    try:
        assert wait_for(
            lambda: call(pool, B, "GET", f"/v1/jobs/{job_id}?wait=20").json()["job"]["state"] == "succeeded", 240
        )
    finally:
        close_all(pool, [run_id])
