"""Whole episodes through the pool API, the way a router drives them, on every fixture task."""

from __future__ import annotations

import json

import pytest

from poolcore.state import Store
from tests.conftest import wait_for


def finish(router, docker_client, lease):
    assert router.close(lease) == {"ok": True, "found": True}
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60), "teardown left containers"
    assert router.close(lease) == {"ok": True, "found": False}


@pytest.mark.parametrize(
    "task, solved, expected",
    [
        ("hello-file", True, 1.0),
        ("hello-file", False, 0.0),
        ("partial-pass", True, 0.75),
        ("sidecar-kv", True, 1.0),
    ],
)
def test_episode_scores(router, docker_client, task, solved, expected):
    lease = router.allocate(task)
    reply = router.reset(lease, task)
    assert reply.status_code == 200, reply.text
    if task == "hello-file":
        [container] = router.run_containers(docker_client, lease)
        assert container.attrs["HostConfig"]["Memory"] == 1024**3
        assert {m["Destination"] for m in container.attrs["Mounts"]} >= {"/logs", "/agent-logs"}
    body = reply.json()
    assert body["ok"] is True
    assert body["user_msg"] == f"Task name:{task}\nTask instruction: solve {task}"
    assert [s["function"]["name"] for s in body["tool_schemas"]] == [
        "shell_exec",
        "shell_view",
        "shell_write_to_process",
        "shell_write_content_to_file",
    ]
    if solved:
        router.solve(lease, task)
    reply = router.evaluate(lease)
    assert reply.status_code == 200, reply.text
    score = reply.json()["score"]
    assert score == pytest.approx(expected)
    if not solved:
        assert score < 1.0
    finish(router, docker_client, lease)


def test_unsolved_partial_scores_below_solution(router, docker_client):
    lease = router.allocate("partial-pass")
    assert router.reset(lease, "partial-pass").status_code == 200
    score = router.evaluate(lease).json()["score"]
    assert score < 0.75
    finish(router, docker_client, lease)


def test_sidecar_reachable_by_service_name(router, docker_client):
    lease = router.allocate("sidecar-kv")
    assert router.reset(lease, "sidecar-kv").status_code == 200
    out = router.sh(
        lease, "python3 -c \"import urllib.request;print(urllib.request.urlopen('http://kv:8000/health').status)\""
    )
    assert out.strip() == "200"
    containers = router.run_containers(docker_client, lease)
    assert len(containers) == 2
    for c in containers:
        c.reload()
        assert c.attrs["HostConfig"]["Privileged"] is False
        assert not any("docker.sock" in (m.get("Source") or "") for m in c.attrs["Mounts"])
    client = next(c for c in containers if c.labels.get("com.docker.compose.service") == "client")
    assert client.attrs["HostConfig"]["Memory"] == 1024**3  # CONTAINER_MEMORY_LIMIT=1g in the test stack
    assert client.attrs["HostConfig"]["MemorySwap"] == 1024**3
    networks = docker_client.networks.list(filters={"label": f"termpool.run={lease}"})
    assert networks, "the run's compose network carries termpool's labels"
    finish(router, docker_client, lease)
    # The teardown removes the network after the containers: it gets the same minute.
    networks = {"label": f"termpool.run={lease}"}
    assert wait_for(lambda: not docker_client.networks.list(filters=networks), 60), "teardown left a network"


def test_interactive_program_through_write_to_process(router, docker_client):
    lease = router.allocate("interactive-guess")
    assert router.reset(lease, "interactive-guess").status_code == 200
    started = router.tool(lease, "shell_exec", id="game", command="guess", block=False, timeout=None)
    assert started.startswith("Session 'game' started.")
    seen = []
    assert wait_for(
        lambda: seen.append(router.tool(lease, "shell_view", id="game")) or "Enter the secret word" in "".join(seen), 10
    ), seen
    assert "Wrong, try again." in router.tool(lease, "shell_write_to_process", id="game", command="banana")
    reply = router.tool(lease, "shell_write_to_process", id="game", command="pineapple")
    assert "Correct!" in reply and reply.endswith("--- SESSION TERMINATED ---")
    assert router.evaluate(lease).json()["score"] == 1.0
    finish(router, docker_client, lease)


def test_broken_dockerfile_fails_reset_and_leaves_nothing(router, docker_client):
    lease = router.allocate("broken-dockerfile")
    reply = router.reset(lease, "broken-dockerfile")
    assert reply.status_code == 500
    body = reply.json()
    assert body["ok"] is False and "fail" in body["error"].lower()
    assert router.run_containers(docker_client, lease) == []
    assert not [
        c for c in docker_client.containers.list(all=True, filters={"ancestor": "tb__broken-dockerfile__client"})
    ]
    finish(router, docker_client, lease)


def test_slow_tests_time_out(router, docker_client):
    lease = router.allocate("slow-tests")
    assert router.reset(lease, "slow-tests").status_code == 200
    reply = router.evaluate(lease)
    assert reply.status_code == 500
    assert "timed out" in reply.json()["error"]
    finish(router, docker_client, lease)


def test_artifacts_written(router, stack, docker_client):
    lease = router.allocate("hello-file")
    ctx = {"uid": "u1", "group_index": 0, "sample_index": 0, "log_dir": "episodes"}
    assert router.reset(lease, "hello-file", run_ctx=ctx).status_code == 200
    router.solve(lease, "hello-file")
    assert router.evaluate(lease).json()["score"] == 1.0
    run_dir = stack.output_root / "episodes" / "hello-file" / f"hello-file.u1.{lease}"
    results = json.loads((run_dir / "results.json").read_text())
    assert results["score"] == 1.0 and all(v == "passed" for v in results["tests"].values())
    calls = [json.loads(line) for line in (run_dir / "tool_calls.jsonl").read_text().splitlines()]
    assert [c["tool_call"]["name"] for c in calls] == ["shell_write_content_to_file", "shell_exec"]
    assert "short test summary info" in (run_dir / "tests.log").read_text()
    assert (run_dir / "sessions").is_dir() and (run_dir / "agent-logs").is_dir()
    finish(router, docker_client, lease)


def test_second_reset_replaces_environment(router, docker_client):
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    router.sh(lease, "echo marker > /app/marker")
    first = {c.id for c in router.run_containers(docker_client, lease)}
    assert router.reset(lease, "hello-file").status_code == 200
    second = {c.id for c in router.run_containers(docker_client, lease)}
    assert first and second and not first & second
    assert "No such file" in router.sh(lease, "cat /app/marker")
    finish(router, docker_client, lease)


def test_removed_image_is_rebuilt(router, docker_client):
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60)
    store, host = Store(router.stack.redis), router.stack.host_id
    assert wait_for(lambda: store.warm_starting(host, "hello-file") == 0, 60)
    docker_client.images.remove("tb__hello-file__client", force=True)
    # Spares started from the old image would serve the next resets (until WARM_IDLE_TTL):
    # take them out, so the next reset starts cold and meets the missing image.
    for spare in store.warm_trim(host, "hello-file", 0, float("inf")):
        docker_client.containers.get(spare["client"]).remove(force=True)
    lease = router.allocate("hello-file")
    reply = router.reset(lease, "hello-file")
    assert reply.status_code == 200, reply.text
    assert docker_client.images.get("tb__hello-file__client")
    finish(router, docker_client, lease)
