"""A durable Redis restarting under a live pool: no run is lost, every worker reconnects, a call
in flight waits for Redis within REDIS_OUTAGE_SECONDS, and answers 503 naming Redis past it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from devstack import Stack
from tests.conftest import Router, stop_checking_leaks, wait_for

OUTAGE_SECONDS = 12


@pytest.fixture(scope="module")
def durable_stack(base_image, docker_client):
    s = Stack(durable_redis=True, env={"REDIS_OUTAGE_SECONDS": str(OUTAGE_SECONDS)}).start()
    yield s
    stop_checking_leaks(s, docker_client)


def test_runs_continue_after_redis_restart(durable_stack, docker_client):
    stack, router = durable_stack, Router(durable_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    assert router.sh(lease, "echo before") == "before\n"

    stack.restart_redis(down_for=5)

    # The run started before the restart: a tool call (exec pool), the evaluation (eval
    # pool) and the close (teardown pool) all go through workers that had to reconnect.
    assert router.sh(lease, "echo after") == "after\n"
    router.solve(lease, "hello-file")
    reply = router.evaluate(lease)
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 90), "teardown did not run"

    # A new episode of a task this host never built: the build and lifecycle pools too.
    assert router.solved_episode(docker_client, "partial-pass") == 0.75


def _blocked_call(stack, lease: str, command: str):
    reply = stack.post(
        "/exec_tool",
        {
            "lease_id": lease,
            "tool_call": {
                "name": "shell_exec",
                "arguments": {"id": "w", "command": command, "block": True, "timeout": 60},
            },
        },
        timeout=120,
    )
    return reply, time.monotonic()


def test_calls_wait_out_a_redis_outage_within_their_limit(durable_stack, docker_client):
    """A tool call in flight while Redis is away for less than REDIS_OUTAGE_SECONDS (12 s here)
    finishes once Redis is back, with its observation. Away for longer, it answers 503
    REDIS_UNAVAILABLE, naming Redis, once that window has passed and before Redis is back."""
    stack, router = durable_stack, Router(durable_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_blocked_call, stack, lease, "sleep 4; echo slept")
        time.sleep(2)  # the facade now waits on the job's done list (BLMOVE)
        stack.restart_redis(down_for=6)
        reply, _ = pending.result(timeout=120)
    assert reply.status_code == 200 and "slept" in reply.text, reply.text

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_blocked_call, stack, lease, "sleep 4; echo slept")
        time.sleep(2)
        stack.restart_redis(down_for=OUTAGE_SECONDS + 15)
        back = time.monotonic()
        reply, answered = pending.result(timeout=120)
    assert reply.status_code == 503, reply.text
    assert reply.json()["code"] == "REDIS_UNAVAILABLE" and "Redis is unreachable" in reply.json()["error"]
    assert answered < back, "the call waited past REDIS_OUTAGE_SECONDS"

    # Redis is back: the same run takes calls again.
    assert wait_for(lambda: router.sh(lease, "echo again") == "again\n", 60)
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 90), "teardown did not run"
