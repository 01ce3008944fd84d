"""A worker host's Docker engine restarted under live runs (a second daemon stands for the host,
devstack/second_docker.py; never the machine's own). The calls sent while it is down wait for
it: on an engine with live-restore the runs survive, with their processes, and every call
succeeds (a tool call, a command, a new run's reset, and an evaluation whose tests ran through
the restart); without it the runs whose containers died answer CONTAINER_LOST, and a new run's
reset still succeeds."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from devstack import Stack
from devstack.second_docker import SecondDocker
from poolcore.state import Store
from tests.conftest import Router, stop_checking_leaks, wait_for
from tests.test_runs_api import finished

DOWN_SECONDS = 3.0  # the engine stays away this long after it has exited: the calls find it away
IN_FLIGHT_LEAD = 2.0  # an evaluation sent this long before the engine stops is running its tests
# An agent's python3 that takes 8 s to start: the tests (pytest) run while the engine restarts.
SLOW_PYTHON = "printf '#!/bin/sh\\nsleep 8\\nexec /usr/bin/python3 \"$@\"\\n' > /usr/local/bin/python3; chmod +x /usr/local/bin/python3"


@pytest.fixture(scope="module")
def restartable(base_image):
    """A stack whose one worker host runs on a second daemon started with --live-restore."""
    daemon = SecondDocker(args=["--live-restore"])
    try:
        daemon.start()
        daemon.load_image(base_image)
        stack = Stack(env={**daemon.host_env(), "WARM_POOL_SIZE": "0"}).start()
        client = daemon.client()
        try:
            yield stack, daemon
        finally:
            stop_checking_leaks(stack, client)
            client.close()
    finally:
        daemon.stop()


def started(router: Router, task: str = "hello-file") -> str:
    lease = router.allocate(task)
    reply = router.reset(lease, task)
    assert reply.status_code == 200, reply.text
    return lease


def close_all(router: Router, leases: list[str]) -> None:
    for lease in leases:
        router.close(lease)


def tool_reply(router: Router, lease: str, command: str):
    tool_call = {"name": "shell_exec", "arguments": {"id": "t", "command": command, "block": True, "timeout": 30}}
    return router.pool.request("POST", "/exec_tool", json={"lease_id": lease, "tool_call": tool_call})


def command_job(stack, run_id: str, command: str) -> dict:
    reply = stack.post(f"/v1/runs/{run_id}/commands", {"command": command})
    assert reply.status_code == 202, reply.text
    return finished(stack, reply.json()["job_id"])


def while_away(daemon: SecondDocker, calls: dict, in_flight: dict | None = None) -> tuple[dict, float]:
    """Send `in_flight` (name: function) and let them get going, stop the engine, send `calls`
    while it is away, start it again after DOWN_SECONDS; the results of both by name, and the
    longest call's seconds."""
    in_flight = in_flight or {}
    with ThreadPoolExecutor(len(calls) + len(in_flight)) as pool:
        futures = {name: pool.submit(_timed, call) for name, call in in_flight.items()}
        time.sleep(IN_FLIGHT_LEAD if in_flight else 0)
        daemon.halt()
        futures.update({name: pool.submit(_timed, call) for name, call in calls.items()})
        time.sleep(DOWN_SECONDS)
        daemon.resume()
        results = {name: future.result() for name, future in futures.items()}
    longest = max(seconds for _, seconds in results.values())
    return {name: value for name, (value, _) in results.items()}, longest


def _timed(call):
    began = time.monotonic()
    return call(), time.monotonic() - began


def test_with_live_restore_runs_survive_and_calls_sent_meanwhile_succeed(restartable):
    stack, daemon = restartable
    router = Router(stack)
    status = wait_for(lambda: stack.get("/status").json()["pool"]["hosts"][stack.host_id]["live_restore"], 60)
    assert status is True, "the host's live-restore was not reported in /status"
    lease = started(router)
    fresh = router.allocate("hello-file")
    try:
        pid = router.sh(lease, "echo before > /tmp/mark; sleep 1000 >/dev/null 2>&1 & echo $!").strip()
        router.solve(lease, "hello-file")
        router.sh(lease, SLOW_PYTHON)

        results, longest = while_away(
            daemon,
            {
                "tool": lambda: tool_reply(router, lease, "cat /tmp/mark"),
                "command": lambda: command_job(stack, lease, "cat /tmp/mark; kill -0 " + pid + " && echo alive"),
                "reset": lambda: router.reset(fresh, "hello-file"),
            },
            in_flight={"evaluate": lambda: router.evaluate(lease)},
        )
        # Its tests ran on through the restart; their result was read back once it was over.
        reply = results["evaluate"]
        assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
        assert results["tool"].status_code == 200, results["tool"].text
        assert "before" in results["tool"].json()["observation"]
        job = results["command"]
        assert job["state"] == "succeeded", job  # its exec found the engine away: it waited and ran
        assert job["result"]["stdout"] == "before\nalive\n", job
        assert results["reset"].status_code == 200, results["reset"].text
        assert longest < IN_FLIGHT_LEAD + DOWN_SECONDS + 30

        # The run goes on as if nothing happened: its process lives on.
        assert router.sh(lease, f"kill -0 {pid} && echo alive") == "alive\n"
        assert router.sh(fresh, "echo fresh") == "fresh\n"
    finally:
        close_all(router, [lease, fresh])


def test_without_live_restore_the_dead_runs_answer_container_lost_and_resets_wait(restartable):
    stack, daemon = restartable
    # The last test's teardowns first: one cut by this restart would leave a container
    # half-removed for the reconcile, which this stack runs only at its workers' start.
    closing = Store(stack.redis)
    assert wait_for(lambda: not closing.closing_runs(stack.host_id), 60, 0.5)
    daemon.args = []  # this restart's stopping daemon keeps them; the next one stops them
    daemon.restart()
    router = Router(stack)
    lease = started(router)
    fresh = router.allocate("hello-file")
    try:
        assert router.sh(lease, "echo alive") == "alive\n"

        results, longest = while_away(
            daemon,
            {
                "tool": lambda: tool_reply(router, lease, "echo after"),
                "reset": lambda: router.reset(fresh, "hello-file"),
            },
        )
        # The tool call waited for the engine, which said the container had stopped.
        reply = results["tool"]
        assert reply.status_code == 503 and reply.json()["code"] == "CONTAINER_LOST", reply.text
        assert results["reset"].status_code == 200, results["reset"].text
        assert longest < DOWN_SECONDS + 30
        reply = router.evaluate(lease)
        assert reply.status_code == 503 and reply.json()["code"] == "CONTAINER_LOST", reply.text
        assert router.sh(fresh, "echo fresh") == "fresh\n"
    finally:
        close_all(router, [lease, fresh])
