"""POOL_API_TOKEN and POOL_ALLOWED_CLIENTS guard every endpoint but the probes, /healthz and /readyz."""

from __future__ import annotations

import http.client
import json

import pytest

from devstack import Stack

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def guarded_stack(base_image):
    s = Stack(env={"POOL_API_TOKEN": TOKEN, "POOL_ALLOWED_CLIENTS": "127.0.0.1/32, 10.0.0.0/8"}).start()
    yield s
    s.stop()


def call(stack, method, path, body=None, token=None, source="127.0.0.1"):
    conn = http.client.HTTPConnection(
        "127.0.0.1" if source == "127.0.0.1" else source, stack.port, timeout=30, source_address=(source, 0)
    )
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read() or b"{}")


def test_token_required(guarded_stack):
    assert call(guarded_stack, "GET", "/healthz") == (200, {"ok": True})
    assert call(guarded_stack, "GET", "/readyz") == (200, {"ok": True})  # a probe, open like /healthz
    status, body = call(guarded_stack, "GET", "/status")
    assert status == 401 and body["ok"] is False and "token" in body["error"]
    assert call(guarded_stack, "POST", "/allocate", {"task_key": "x"}, token="wrong")[0] == 401
    assert call(guarded_stack, "GET", "/v1/runs/run-0", token=None)[0] == 401
    status, body = call(guarded_stack, "GET", "/status", token=TOKEN)
    assert status == 200 and body["ok"] is True


def test_client_outside_allowed_networks(guarded_stack):
    status, body = call(guarded_stack, "GET", "/status", token=TOKEN, source="127.0.0.2")
    assert status == 403 and "not allowed" in body["error"]
    assert call(guarded_stack, "GET", "/healthz", source="127.0.0.2")[0] == 200
    assert call(guarded_stack, "GET", "/readyz", source="127.0.0.2")[0] == 200
