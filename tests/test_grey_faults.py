"""Grey faults below the stack (issue 22): a run whose container died under it (a Docker
restart without live-restore) answers 503 CONTAINER_LOST at once, and is closed with nothing
left; a Redis at its memory limit answers 503 BACKEND_FULL, and serves again once the limit is
lifted; a Redis call that must land waits out a short outage."""

from __future__ import annotations

import time

import pytest
import redis

from devstack import Stack
from poolcore import failures
from tasks.runtime import through_outage  # (its state store registers the codes of Redis's errors)
from tests.conftest import Router, stop_checking_leaks, wait_for


@pytest.fixture(scope="module")
def grey_stack(base_image, docker_client):
    s = Stack(beat=True, env={"WARM_POOL_SIZE": "0"}).start()  # beat: the reconcile closes lost runs
    yield s
    stop_checking_leaks(s, docker_client)


def exec_reply(router: Router, lease: str, command: str):
    tool_call = {"name": "shell_exec", "arguments": {"id": "g", "command": command, "block": True, "timeout": 20}}
    return router.pool.request("POST", "/exec_tool", json={"lease_id": lease, "tool_call": tool_call})


def test_a_run_whose_container_died_answers_container_lost(grey_stack, docker_client):
    router = Router(grey_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    assert router.sh(lease, "echo alive") == "alive\n"
    (client,) = [c for c in router.run_containers(docker_client, lease) if c.status == "running"]
    client.kill()  # what a Docker restart without live-restore does to it

    started = time.monotonic()
    reply = exec_reply(router, lease, "echo after")
    assert time.monotonic() - started < 20
    assert reply.status_code == 503 and reply.json()["code"] == "CONTAINER_LOST", reply.text
    assert reply.json()["retryable"] is True
    # Every later call on it answers the same at once: the run is marked lost.
    reply = router.evaluate(lease)
    assert reply.status_code == 503 and reply.json()["code"] == "CONTAINER_LOST", reply.text
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 90), "the lost run was not torn down"


def test_a_full_redis_answers_backend_full_and_serves_again(grey_stack, docker_client):
    stack, router = grey_stack, Router(grey_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    used = int(stack.redis.info("memory")["used_memory"])
    stack.redis.config_set("maxmemory-policy", "noeviction")
    stack.redis.config_set("maxmemory", max(1 << 20, used // 2))
    try:
        reply = router.pool.request("POST", "/allocate", json={"task_key": "hello-file"})
        assert reply.status_code == 503 and reply.json()["code"] == "BACKEND_FULL", reply.text
        reply = exec_reply(router, lease, "echo full")
        assert reply.status_code == 503 and reply.json()["code"] == "BACKEND_FULL", reply.text
    finally:
        stack.redis.config_set("maxmemory", 0)
    assert router.sh(lease, "echo again") == "again\n"
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 90), "teardown did not run"


@pytest.mark.unit
def test_a_call_that_must_land_waits_out_an_outage_only():
    tries = []

    def flaky():
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise redis.exceptions.ConnectionError("away")
        return "landed"

    assert through_outage(flaky, "test") == "landed" and len(tries) == 3

    def refused():
        raise redis.exceptions.ResponseError("WRONGTYPE")  # not an outage: at once

    with pytest.raises(redis.exceptions.ResponseError):
        through_outage(refused, "test")


@pytest.mark.unit
def test_a_job_failed_by_redis_has_a_retryable_code():
    assert failures.classify(redis.exceptions.TimeoutError("Timeout connecting to server")) == "REDIS_UNAVAILABLE"
    assert failures.classify(redis.exceptions.ConnectionError("refused")) == "REDIS_UNAVAILABLE"
    try:  # a refused socket under Redis's own error is Redis's, not a generic (Docker) one
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as inner:
            raise redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379") from inner
    except redis.exceptions.ConnectionError as exc:
        assert failures.classify(exc) == "REDIS_UNAVAILABLE"
        assert failures.describe(exc, "REDIS_UNAVAILABLE").startswith("Redis is unreachable: ConnectionError")
    assert failures.classify(redis.exceptions.OutOfMemoryError("OOM command not allowed")) == "BACKEND_FULL"
    assert failures.retryable("BACKEND_FULL") and failures.retryable("CONTAINER_LOST")


@pytest.mark.unit
def test_a_publish_refused_for_memory_is_backend_full_not_unreachable():
    """kombu wraps Redis's OOM refusal of a publish in its OperationalError (a connection-error
    type): the facade names it BACKEND_FULL (CI's chaos run saw one REDIS_UNAVAILABLE)."""
    import kombu.exceptions

    from app.errors import refused_for_memory

    try:
        try:
            raise redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'")
        except redis.exceptions.OutOfMemoryError as inner:
            raise kombu.exceptions.OperationalError(str(inner)) from inner
    except kombu.exceptions.OperationalError as exc:
        assert refused_for_memory(exc)
    assert not refused_for_memory(kombu.exceptions.OperationalError("Error 111 connecting"))
    assert not refused_for_memory(redis.exceptions.ConnectionError("refused"))
