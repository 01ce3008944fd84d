"""Bad input of every kind over the real stack: a clear JSON error, the right status, and nothing
left behind (each field's texts: tests/test_models.py)."""

from __future__ import annotations

import pytest
import requests

from tests.conftest import wait_for


def post_raw(stack, path, data, content_type="application/json"):
    return requests.post(stack.url + path, data=data, headers={"Content-Type": content_type}, timeout=60)


def assert_error(reply, status, text, code=None):
    assert reply.status_code == status, reply.text
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json()
    assert body["ok"] is False and text in body["error"], body
    if code is not None:
        assert body["code"] == code and body["retryable"] is False, body
    return body


@pytest.mark.parametrize("data", ["", "not json", "[1, 2]", "null", '"task"', "{"])
def test_non_object_bodies_count_as_empty(stack, data):
    assert_error(post_raw(stack, "/allocate", data), 400, "task_key is required")


@pytest.mark.parametrize("path", ["/heartbeat", "/reset", "/exec_tool", "/evaluate", "/close"])
def test_lease_required(stack, path):
    assert_error(stack.post(path, {}), 400, "lease_id is required", "BAD_REQUEST")


def test_unknown_lease(stack):
    body = assert_error(stack.post("/heartbeat", {"lease_id": "run-0000000000000000"}), 500, "Unknown run_lease_id")
    assert body["error"] == "Unknown run_lease_id: run-0000000000000000"
    assert (body["code"], body["retryable"]) == ("UNKNOWN_LEASE", False)
    assert_error(
        stack.post("/exec_tool", {"lease_id": "run-x", "tool_call": {"name": "shell_view"}}),
        500,
        "Unknown run_lease_id",
    )
    assert_error(stack.post("/evaluate", {"lease_id": "run-x"}), 500, "Unknown run_lease_id")
    assert stack.post("/close", {"lease_id": "run-x"}).json() == {"ok": True, "found": False}


def test_routes_and_methods_answer_json(stack):
    assert_error(stack.get("/nope"), 404, "", "NOT_FOUND")
    assert_error(stack.get("/allocate"), 405, "", "METHOD_NOT_ALLOWED")
    for method in ("TRACE", "PUT", "PATCH", "DELETE"):
        reply = requests.request(method, stack.url + "/allocate", timeout=60)
        assert_error(reply, 405, "", "METHOD_NOT_ALLOWED")
        assert set(reply.headers["Allow"].split(", ")) == {"POST", "OPTIONS"}
    reply = requests.request("TRACE", stack.url + "/v1/runs/run-0000000000000000", timeout=60)
    assert set(reply.headers["Allow"].split(", ")) == {"GET", "HEAD", "DELETE", "OPTIONS"}


def test_hostile_bodies_are_400_and_take_no_slot(stack):
    garbage_keys = ["a\x00b", "k" * 1_000_000, "\x1b[31m"]
    for key in garbage_keys:
        assert_error(stack.post("/allocate", {"task_key": key}), 400, "task_key", "BAD_REQUEST")
    assert_error(post_raw(stack, "/allocate", "[" * 100_000 + "]" * 100_000), 400, "nests deeper", "BAD_REQUEST")
    assert_error(post_raw(stack, "/allocate", '{"task_key": "\\ud800"}'), 400, "lone surrogate", "BAD_REQUEST")
    assert_error(post_raw(stack, "/allocate", b'{"task_key": "\xc3"}'), 400, "UTF-8", "BAD_REQUEST")
    tasks = stack.get("/status").json()["pool"]["tasks"]
    assert not set(garbage_keys) & set(tasks), tasks


def test_body_size_is_capped(stack):
    from app.fields import MAX_BODY_BYTES

    body = b'{"task_key": "' + b"x" * MAX_BODY_BYTES + b'"}'
    assert_error(post_raw(stack, "/allocate", body), 413, str(MAX_BODY_BYTES), "PAYLOAD_TOO_LARGE")


def test_idempotent_allocate_over_http(stack, router):
    first = stack.post("/allocate", {"task_key": "hello-file", "request_id": "same"}).json()
    again = stack.post("/allocate", {"task_key": "hello-file", "request_id": "same"}).json()
    assert first["reused"] is False and again == {"ok": True, "lease_id": first["lease_id"], "reused": True}
    assert first["lease_id"].startswith("run-") and len(first["lease_id"]) == 20
    router.close(first["lease_id"])


def test_capacity_limits(stack, router):
    leases = [router.allocate("cap-task") for _ in range(8)]
    body = assert_error(stack.post("/allocate", {"task_key": "cap-task"}), 429, "")
    assert body["code"] == "RUN_SLOTS_EXHAUSTED" and body["retryable"] is True
    status = stack.get("/status").json()["pool"]
    assert status["tasks"]["cap-task"] == {"active_runs": 8}
    assert status["max_tasks"] == 16 and status["max_runs_per_task"] == 8
    others = [router.allocate(f"cap-{i}") for i in range(16 - status["active_tasks"])]
    body = assert_error(stack.post("/allocate", {"task_key": "one-too-many"}), 429, "")
    assert body["code"] == "TASK_SLOTS_EXHAUSTED"
    for lease in leases + others:
        router.close(lease)
    assert "cap-task" not in stack.get("/status").json()["pool"]["tasks"]


@pytest.mark.parametrize(
    "meta, text",
    [
        ("hello-file", "task_meta must be a dict"),
        ({"task_name": "x", "task_path": "../../../etc"}, "task_meta.task_path"),
        ({"task_name": "x", "task_path": "no-such-task"}, "task_meta.task_path"),
        ({"task_name": "hello-file/", "task_path": "hello-file"}, "task_meta.task_name must be"),
    ],
)
def test_reset_rejects_bad_task_meta(stack, router, docker_client, meta, text):
    lease = router.allocate("hello-file")
    assert_error(stack.post("/reset", {"lease_id": lease, "task_meta": meta}), 400, text)
    assert router.run_containers(docker_client, lease) == []
    router.close(lease)


@pytest.mark.parametrize("log_dir", ["/tmp", "../outside", "l" * 1_000_000])
def test_reset_rejects_log_dir_outside_output_root(stack, router, docker_client, log_dir):
    lease = router.allocate("hello-file")
    reply = router.reset(lease, "hello-file", run_ctx={"log_dir": log_dir})
    assert_error(reply, 400, "run_ctx.log_dir")
    assert router.run_containers(docker_client, lease) == []
    router.close(lease)


def test_exec_tool_validation(stack, router):
    lease = router.allocate("hello-file")
    assert_error(
        stack.post("/exec_tool", {"lease_id": lease, "tool_call": "shell_exec"}), 400, "tool_call must be a dict"
    )
    assert_error(
        stack.post("/exec_tool", {"lease_id": lease, "tool_call": {"name": "shell_view", "arguments": {"id": "x"}}}),
        500,
        "has not been reset",
    )
    body = assert_error(stack.post("/evaluate", {"lease_id": lease}), 500, "has not been reset")
    assert (body["code"], body["retryable"]) == ("RUN_NOT_READY", False)
    router.close(lease)


def test_tool_errors_are_observations(router, docker_client):
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    assert router.tool(lease, "shell_kill_process", id="x") == "[TOOL_ERROR] unknown tool: shell_kill_process"
    assert router.tool(lease, "shell_exec").startswith("[TOOL_ERROR] shell_exec: TypeError: ")
    close_and_wait(router, docker_client, lease)


def test_task_timeouts_garbage_is_ignored(router, docker_client):
    lease = router.allocate("hello-file")
    reply = router.reset(
        lease, "hello-file", task_timeouts={"eval": "soon", "reset_session": -3, "bogus": 1, "ensure_image": None}
    )
    assert reply.status_code == 200, reply.text
    close_and_wait(router, docker_client, lease)


def close_and_wait(router, docker_client, lease):
    """Close, then wait for the teardown (it runs after the reply) so that nothing outlives the test."""
    router.close(lease)
    assert wait_for(lambda: router.run_containers(docker_client, lease) == [], timeout=120)
