"""Many episodes at once, and sessions that outlive the worker processes."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from tests.conftest import wait_for


def episode(router, task: str, solved: bool) -> float:
    lease = router.allocate(task)
    try:
        reply = router.reset(lease, task)
        assert reply.status_code == 200, reply.text
        assert router.sh(lease, "echo ready") == "ready\n"
        if solved:
            router.solve(lease, task)
        reply = router.evaluate(lease)
        assert reply.status_code == 200, reply.text
        return reply.json()["score"]
    finally:
        router.close(lease)


def test_the_facade_runs_ahead_of_the_workers(stack):
    """WEB_NICE (default -5): gunicorn's master and its workers, not the job workers."""
    web = psutil.Process(stack.procs["web"].pid)
    assert web.nice() == -5 and web.children() and all(child.nice() == -5 for child in web.children())
    assert psutil.Process(stack.procs["exec"].pid).nice() == 0


def test_eight_episodes_at_once(router, docker_client, stack):
    plan = [("hello-file", i % 2 == 0) for i in range(6)] + [("partial-pass", True), ("partial-pass", False)]
    with ThreadPoolExecutor(len(plan)) as pool:
        scores = list(pool.map(lambda p: episode(router, *p), plan))
    expected = [1.0 if s else 0.0 for _, s in plan[:6]] + [0.75]
    assert scores[:7] == expected and scores[7] < 0.75
    assert wait_for(lambda: stack.get("/status").json()["pool"]["pending_closes"] == 0, 60)


def test_sessions_survive_exec_worker_restart(router, stack, docker_client):
    lease = router.allocate("interactive-guess")
    assert router.reset(lease, "interactive-guess").status_code == 200
    assert router.tool(lease, "shell_exec", id="game", command="guess", block=False, timeout=None).startswith(
        "Session 'game' started."
    )
    assert "Wrong, try again." in router.tool(lease, "shell_write_to_process", id="game", command="banana")
    # A counter that keeps printing while no worker is alive.
    router.tool(
        lease,
        "shell_exec",
        id="ticker",
        command="for i in 1 2 3 4 5 6; do echo tick$i; sleep 0.5; done",
        block=False,
        timeout=None,
    )

    stack.kill("exec", signal.SIGKILL)
    time.sleep(1)
    stack.start_worker("exec")

    assert "Wrong, try again." in router.tool(lease, "shell_write_to_process", id="game", command="mango")
    reply = router.tool(lease, "shell_write_to_process", id="game", command="pineapple")
    assert "Correct!" in reply
    seen = []
    assert wait_for(
        lambda: seen.append(router.tool(lease, "shell_view", id="ticker")) or "SESSION TERMINATED" in seen[-1], 15
    ), seen
    text = "".join(seen)
    assert all(f"tick{i}" in text for i in range(1, 7)), text
    assert router.evaluate(lease).json()["score"] == 1.0
    router.close(lease)


def test_lost_worker_fails_the_call_instead_of_hanging(router, stack):
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            stack.post,
            "/exec_tool",
            {
                "lease_id": lease,
                "tool_call": {
                    "name": "shell_exec",
                    "arguments": {"id": "x", "command": "sleep 40", "block": True, "timeout": 60},
                },
            },
        )
        time.sleep(2)
        stack.kill("exec", signal.SIGKILL)
        reply = pending.result(timeout=60)
    stack.start_worker("exec")
    assert reply.status_code == 500 and "lost" in reply.json()["error"]
    assert router.sh(lease, "echo alive") == "alive\n"
    router.close(lease)
