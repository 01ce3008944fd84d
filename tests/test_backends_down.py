"""Redis or Docker away: 503 with a clear JSON error, and recovery once they return."""

from __future__ import annotations

import pytest

from devstack import Stack
from tests.conftest import Router, wait_for


@pytest.fixture(scope="module")
def lonely_stack(base_image):
    # Workers that talk to a Docker socket that does not exist.
    s = Stack(
        env={
            "DOCKER_HOST": "unix:///nonexistent/docker.sock",
            "REDIS_OUTAGE_SECONDS": "3",
            "DOCKER_OUTAGE_SECONDS": "3",
        }
    ).start()
    yield s
    s.stop()


def test_docker_unreachable_gives_503(lonely_stack):
    router = Router(lonely_stack)
    lease = router.allocate("hello-file")
    reply = router.reset(lease, "hello-file")
    assert reply.status_code == 503, reply.text
    body = reply.json()
    assert body["ok"] is False and body["code"] == "BACKEND_UNAVAILABLE" and "Docker" in body["error"]
    router.close(lease)


def test_redis_down_gives_503_then_recovers(lonely_stack):
    lonely_stack.kill("redis")
    reply = lonely_stack.post("/allocate", {"task_key": "hello-file"}, timeout=30)
    assert reply.status_code == 503
    assert reply.json()["code"] == "REDIS_UNAVAILABLE" and "Redis" in reply.json()["error"]
    assert lonely_stack.get("/status").status_code == 503
    assert lonely_stack.get("/healthz").status_code == 200
    lonely_stack._spawn(
        "redis", ["redis-server", "--port", str(lonely_stack.redis_port), "--bind", "127.0.0.1", "--save", ""]
    )
    assert wait_for(lambda: lonely_stack.get("/status").status_code == 200, 30)
    reply = lonely_stack.post("/allocate", {"task_key": "hello-file"})
    assert reply.status_code == 200 and reply.json()["ok"] is True
