"""Input limits over HTTP, without Docker or Redis: the app's test client against a Redis nobody
listens on (the models' own texts: tests/test_models.py).

Every request here is refused before the app reaches Redis (a 503 would mean it got that far),
with a 4xx JSON {"ok": false, "error", "code", "retryable": false}.
"""

from __future__ import annotations

import json
import uuid

import pytest

from app import create_app, fields, stop_app
from app.http import BadRequest, check_json_tree
from devstack import FIXTURES, free_port
from poolcore.config import load_settings
from poolcore.task_spec import image_name, name_prefix, valid_task_name
from tests.conftest import make_app

pytestmark = pytest.mark.unit

RUN = "run-0123456789abcdef"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    env = {
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "DATASET_DIR": str(FIXTURES),
        "TBENCH_OUTPUT_ROOT": str(tmp_path_factory.mktemp("outputs")),
        "POOL_HOST_ID": "tvalidation",
    }
    app = create_app(load_settings(env))
    yield app.test_client()
    stop_app(app)


def refused(reply, status: int, code: str, text: str = "") -> dict:
    assert reply.status_code == status, reply.get_data(as_text=True)[:500]
    assert reply.is_json
    body = reply.get_json()
    assert body["ok"] is False and body["code"] == code and body["retryable"] is False, body
    assert text in body["error"], body
    return body


def reset_body(**meta) -> dict:
    return {"lease_id": RUN, "task_meta": {"task_name": "hello-file", **meta}}


# ---- the body -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/allocate", "/reset", "/exec_tool", "/v1/runs", f"/v1/runs/{RUN}/tool_calls"])
def test_deep_body_is_a_400(client, path):
    for depth in (fields.MAX_JSON_DEPTH + 1, 100_000):
        data = '{"a": ' * depth + "1" + "}" * depth
        refused(client.post(path, data=data), 400, "BAD_REQUEST", "nests deeper")
    data = "[" * 100_000 + "]" * 100_000
    refused(client.post(path, data=data), 400, "BAD_REQUEST", "nests deeper")


def test_depth_limit_is_inclusive(client):
    data = '{"task_key": ' + "[" * (fields.MAX_JSON_DEPTH - 1) + "]" * (fields.MAX_JSON_DEPTH - 1) + "}"
    refused(client.post("/allocate", data=data), 400, "BAD_REQUEST", "task_key must be a string")


@pytest.mark.parametrize(
    "data, text",
    [
        ('{"task_key": "\\ud800"}', "lone surrogate"),
        ('{"task_key": "x", "extra": ["\\udfff"]}', "lone surrogate"),
        ('{"\\udc00": 1, "task_key": "x"}', "lone surrogate"),
        (b'{"task_key": "\xed\xa0\x80"}', "not valid UTF-8"),
        (b'{"task_key": "\xff"}', "not valid UTF-8"),
        ('{"task_key": NaN}', "NaN is not a JSON number"),
        ('{"task_key": "x", "n": -Infinity}', "Infinity is not a JSON number"),
        ('{"task_key": "x", "n": 1e400}', "too large"),
        ('{"task_key": "x", "n": ' + "9" * 400 + "}", "too large"),
    ],
)
def test_body_that_is_not_valid_unicode_or_json_numbers(client, data, text):
    refused(client.post("/allocate", data=data), 400, "BAD_REQUEST", text)


@pytest.mark.parametrize("data", ["", "not json", "[1, 2]", "null", '"task"', "{", "7"])
def test_non_object_bodies_still_count_as_empty(client, data):
    refused(client.post("/allocate", data=data), 400, "BAD_REQUEST", "task_key is required")


def test_body_size_is_capped(client):
    data = json.dumps({"task_key": "x" * fields.MAX_BODY_BYTES})
    refused(client.post("/allocate", data=data), 413, "PAYLOAD_TOO_LARGE", str(fields.MAX_BODY_BYTES))


def test_check_json_tree_needs_no_recursion():
    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    with pytest.raises(BadRequest, match="nests deeper"):
        check_json_tree(deep)
    check_json_tree({"a": [1, 2.5, "x", None, True, {"b": []}]})


# ---- fields -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, text",
    [
        ("x" * (fields.MAX_ID_LENGTH + 1), "longer than"),
        ("x" * 1_000_000, "longer than"),
        ("a\x00b", "control characters"),
        ("line\n", "control characters"),
        ("tab\there", "control characters"),
        ("\x85", "control characters"),
        (["x"], "must be a string"),
        ("", "task_key is required"),
    ],
)
def test_task_key(client, value, text):
    refused(client.post("/allocate", json={"task_key": value}), 400, "BAD_REQUEST", text)


@pytest.mark.parametrize(
    "value, text",
    [
        ({"a": 1}, "string or an integer"),
        (True, "string or an integer"),
        (1.5, "string or an integer"),
        (2**64, "64 bits"),
        ("r" * 300, "longer than"),
        ("a\x1fb", "control characters"),
    ],
)
def test_request_id(client, value, text):
    refused(client.post("/allocate", json={"task_key": "k", "request_id": value}), 400, "BAD_REQUEST", text)


@pytest.mark.parametrize("path", ["/heartbeat", "/reset", "/exec_tool", "/evaluate", "/close"])
def test_lease_id(client, path):
    refused(client.post(path, json={"lease_id": "run-\x00"}), 400, "BAD_REQUEST", "lease_id must not contain")
    refused(client.post(path, json={"lease_id": "r" * 257}), 400, "BAD_REQUEST", "lease_id is longer than")


@pytest.mark.parametrize(
    "name",
    [
        "hello-world/",
        "../x",
        "a b",
        "-x",
        "x-",
        "x_-y",
        "a___b",
        "ü",
        "x" * 101,
        "hello-world\n",
        " hello-world",
        "x:latest",
        "a/b",
    ],
)
def test_task_names_that_make_no_docker_name(client, name):
    assert not valid_task_name(name)
    refused(
        client.post("/reset", json=reset_body(task_name=name, task_path="hello-file")),
        400,
        "BAD_REQUEST",
        "task_meta.task_name must be letters and digits",
    )


@pytest.mark.parametrize("name", ["hello-file", "Hello.World", "fix_git", "a__b", "a--b", "a.-b", "3d", "x" * 100])
def test_task_names_that_make_docker_names(name):
    import re

    assert valid_task_name(name)
    reference = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"  # Docker's path component grammar
    for docker_name in (image_name(name), name_prefix(name)):
        assert re.fullmatch(reference, docker_name), docker_name


@pytest.mark.parametrize(
    "meta, text",
    [
        ({"task_path": "a" * 1_000_000}, "task_path is longer than"),
        ({"task_path": "a" * 300}, "component longer than 255 bytes"),
        ({"task_path": "hello-file/" + "ü" * 200}, "component longer than 255 bytes"),
        ({"task_path": "hello\x00file"}, "control characters"),
        ({"task_path": ""}, "must not be empty"),
        ({"instruction": "x" * (fields.MAX_TEXT_LENGTH + 1)}, "instruction is longer than"),
        ({"instruction": "a\x00b"}, "NUL"),
    ],
)
def test_task_meta_bounds(client, meta, text):
    refused(client.post("/reset", json=reset_body(**meta)), 400, "BAD_REQUEST", text)


@pytest.mark.parametrize(
    "ctx, text",
    [
        ({"log_dir": "a" * 1_000_000}, "log_dir is longer than"),
        ({"log_dir": "x/" + "b" * 256}, "component longer than 255 bytes"),
        ({"log_dir": "a\nb"}, "control characters"),
        ({"uid": "u" * (fields.MAX_UID_LENGTH + 1)}, "run_ctx.uid is longer than"),
        ({"uid": {"a": 1}}, "run_ctx.uid must be a string or an integer"),
        ({"group_index": [1]}, "run_ctx.group_index"),
        ({"sample_index": "a\x00"}, "run_ctx.sample_index"),
    ],
)
def test_run_ctx_bounds(client, ctx, text):
    refused(client.post("/reset", json={**reset_body(), "run_ctx": ctx}), 400, "BAD_REQUEST", text)


def test_tool_name_bounds(client):
    for name in ("n" * 257, "shell\x00exec"):
        body = {"lease_id": RUN, "tool_call": {"name": name}}
        refused(client.post("/exec_tool", json=body), 400, "BAD_REQUEST", "tool_call.name")
        refused(client.post(f"/v1/runs/{RUN}/tool_calls", json={"name": name}), 400, "BAD_REQUEST", "tool_call.name")


# ---- routes and methods -------------------------------------------------------------------------
def _routes(client) -> dict:
    """Concrete path -> the methods of every rule on it."""
    routes: dict = {}
    for rule in client.application.url_map.iter_rules():
        path = rule.rule.replace("<run_id>", RUN).replace("<job_id>", str(uuid.UUID(int=7)))
        routes.setdefault(path, set()).update(rule.methods)
    return routes


def test_undeclared_methods_are_405_with_allow(client):
    checked = 0
    for path, methods in _routes(client).items():
        for method in ("TRACE", "PUT", "PATCH", "DELETE", "POST", "GET", "HEAD"):
            if method in methods:
                continue
            reply = client.open(path, method=method)
            assert reply.status_code == 405, (method, path)
            assert set(reply.headers["Allow"].split(", ")) == methods, (method, path, reply.headers)
            if method != "HEAD":  # a HEAD reply has no body
                refused(reply, 405, "METHOD_NOT_ALLOWED")
            checked += 1
        options = client.open(path, method="OPTIONS")
        assert options.status_code == 200 and set(options.headers["Allow"].split(", ")) == methods, path
    assert checked > 50


def test_unknown_route_is_json_404(client):
    refused(client.get("/nope"), 404, "NOT_FOUND")
    refused(client.post("/v1/runs/x/y/z"), 404, "NOT_FOUND")


def test_guard_refusals_have_codes(tmp_path):
    env = {
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "DATASET_DIR": str(FIXTURES),
        "TBENCH_OUTPUT_ROOT": str(tmp_path),
        "POOL_API_TOKEN": "s3cret",
        "POOL_ALLOWED_CLIENTS": "10.9.0.0/16",
    }
    guarded = make_app(env).test_client()
    refused(guarded.get("/status"), 403, "FORBIDDEN", "client address not allowed")
    env["POOL_ALLOWED_CLIENTS"] = "127.0.0.0/8"
    guarded = make_app(env).test_client()
    refused(guarded.get("/status"), 401, "UNAUTHORIZED", "bearer token")
    assert guarded.get("/healthz").status_code == 200


@pytest.mark.parametrize("value", ["-21", "20", "high"])
def test_web_nice_out_of_range_names_the_setting(value):
    with pytest.raises(ValueError, match="WEB_NICE"):
        load_settings({"WEB_NICE": value})


def test_web_nice_defaults_ahead_of_the_workers():
    assert load_settings({}).web_nice == -5 and load_settings({"WEB_NICE": "0"}).web_nice == 0
