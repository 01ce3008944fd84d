"""Tasks in Harbor's format (tests/fixtures/harbor/): loading, reward reading and whole episodes
(reset, a tool call, the reference solution, evaluate, close) on a stack of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devstack import ROOT
from environments import harbor_verifier
from termpool.client import task_meta
from termpool.failures import RewardMissing
from termpool.failures import TestsUnparsable as Unparsable
from termpool.state import Store
from termpool.task_spec import TaskError, Unsupported, is_task_dir, load_task
from tests.conftest import private_stack, run_containers, wait_for

HARBOR = ROOT / "tests" / "fixtures" / "harbor"
NAMES = ["harbor-hello", "harbor-partial", "harbor-no-reward", "harbor-compose-sidecar"]


# ---- loading and reward reading (no Docker) -------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_fixture_loads(name):
    spec = load_task(HARBOR / name)
    assert is_task_dir(HARBOR / name)
    assert spec.harbor is not None and spec.instruction == (HARBOR / name / "instruction.md").read_text()


@pytest.mark.unit
def test_task_toml_fields():
    spec = load_task(HARBOR / "harbor-hello")
    assert (spec.harbor.cpus, spec.harbor.memory_mb, spec.harbor.build_timeout_sec) == (1.0, 512, 300.0)
    assert spec.max_agent_timeout_sec == 120.0
    assert spec.test_time_limit(600) == 60.0 and spec.test_time_limit(10) == 10
    assert spec.harbor.verifier_env == {"GREETING": "hi"}
    assert load_task(HARBOR / "harbor-compose-sidecar").harbor.memory_mb == 768  # deprecated "768M"
    defaults = load_task(HARBOR / "harbor-no-reward").harbor
    assert (defaults.cpus, defaults.memory_mb, defaults.allow_internet) == (1.0, 2048, True)


def _copy(tmp_path: Path, toml: str, steps: bool = False) -> Path:
    task = tmp_path / "t"
    for sub in ("environment", "tests"):
        (task / sub).mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text("FROM termpool-test-base:bookworm\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n")
    (task / "instruction.md").write_text("do it\n")
    (task / "task.toml").write_text(toml)
    if steps:
        (task / "steps").mkdir()
    return task


@pytest.mark.unit
def test_refusals(tmp_path):
    with pytest.raises(Unsupported, match="multi-step"):
        load_task(_copy(tmp_path / "a", "", steps=True))
    with pytest.raises(Unsupported, match="gpus"):
        load_task(_copy(tmp_path / "b", "[environment]\ngpus = 1\n"))
    with pytest.raises(TaskError, match="invalid TOML"):
        load_task(_copy(tmp_path / "c", "[verifier\n"))
    with pytest.raises(TaskError, match="positive"):
        load_task(_copy(tmp_path / "d", "[verifier]\ntimeout_sec = -1\n"))
    assert load_task(_copy(tmp_path / "e", "[environment]\nallow_internet = false\n")).harbor.allow_internet is False


@pytest.mark.unit
def test_reward_files(tmp_path):
    (tmp_path / "reward.txt").write_text("0.25\n")
    assert harbor_verifier.read_rewards(tmp_path) == {"reward": 0.25}
    (tmp_path / "reward.json").write_text(json.dumps({"accuracy": 0.5, "tag": "x", "flag": True}))
    assert harbor_verifier.read_rewards(tmp_path) == {"accuracy": 0.5, "reward": 0.25}  # reward.txt as `reward`
    (tmp_path / "reward.txt").unlink()
    assert harbor_verifier.score(harbor_verifier.read_rewards(tmp_path)) == 0.5  # the mean without `reward`
    (tmp_path / "reward.json").write_text("")
    with pytest.raises(RewardMissing, match="empty"):
        harbor_verifier.read_rewards(tmp_path)
    (tmp_path / "reward.json").write_text("[1]")
    with pytest.raises(Unparsable):
        harbor_verifier.read_rewards(tmp_path)
    (tmp_path / "reward.json").unlink()
    with pytest.raises(RewardMissing, match="no"):
        harbor_verifier.read_rewards(tmp_path)


# ---- whole episodes -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hstack(base_image, docker_client):
    yield from private_stack(docker_client, {"DATASET_DIR": str(HARBOR)})


def _reset(s, task: str) -> tuple[str, dict]:
    lease = s.client.allocate(task).id
    reply = s.client.request("POST", "/reset", json={"lease_id": lease, "task_meta": task_meta(task)})
    assert reply.status_code == 200, reply.text
    return lease, reply.json()


def _sh(s, lease: str, command: str) -> str:
    return s.client.lease(lease).tool("shell_exec", id="main", command=command, block=True, timeout=60)


def _solve(s, lease: str, task: str) -> None:
    """As Harbor's oracle: solution/ at /solution, solve.sh run from the working directory."""
    for path in sorted((HARBOR / task / "solution").iterdir()):
        s.client.lease(lease).tool(
            "shell_write_content_to_file", content=path.read_text(), file_path=f"/solution/{path.name}"
        )
    _sh(s, lease, "cd /app && DEBIAN_FRONTEND=noninteractive bash /solution/solve.sh")  # the images' WORKDIR


def _close(s, docker_client, lease: str) -> None:
    assert s.client.request("POST", "/close", json={"lease_id": lease}).status_code == 200
    assert wait_for(lambda: not run_containers(docker_client, Store(s.redis), lease), 60), "teardown left containers"


def _run_dir(s, lease: str) -> Path:
    return Path(Store(s.redis).get_run(lease)["env"]["run_dir"])


def test_dockerfile_task_with_limits_and_hidden_tests(hstack, docker_client):
    lease, body = _reset(hstack, "harbor-hello")
    assert body["user_msg"].endswith((HARBOR / "harbor-hello" / "instruction.md").read_text())
    assert _sh(hstack, lease, "ls /tests 2>&1; ls /solution 2>&1; pwd").count("No such file") == 2
    [main] = run_containers(docker_client, Store(hstack.redis), lease)
    assert main.attrs["HostConfig"]["Memory"] == 512 * 1024**2  # task.toml's 512 MB < CONTAINER_MEMORY_LIMIT
    assert main.attrs["HostConfig"]["NanoCpus"] == 1_000_000_000
    assert main.labels.get("com.docker.compose.service") == "main"
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 0.0
    _solve(hstack, lease, "harbor-hello")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0
    verifier = _run_dir(hstack, lease) / "sessions"
    assert (verifier / "reward.txt").read_text().strip() == "1"
    assert "checked from /app as root; GREETING=hi" in (verifier / "test-stdout.txt").read_text()
    assert json.loads((_run_dir(hstack, lease) / "results.json").read_text())["rewards"] == {"reward": 1.0}
    _close(hstack, docker_client, lease)


def test_reward_json_non_binary(hstack, docker_client):
    lease, _ = _reset(hstack, "harbor-partial")
    _solve(hstack, lease, "harbor-partial")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200, reply.text
    assert reply.json()["score"] == pytest.approx(2 / 3)  # test.sh exits 1: ignored
    record = Store(hstack.redis).get_run(lease)
    assert record["rewards"] == {"reward": pytest.approx(2 / 3), "lines": 3.0}
    _close(hstack, docker_client, lease)


def test_no_reward_file_is_reward_missing(hstack, docker_client):
    lease, _ = _reset(hstack, "harbor-no-reward")
    assert _sh(hstack, lease, "echo hi").strip() == "hi"
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 500
    body = reply.json()
    assert (body["code"], body["retryable"]) == ("REWARD_MISSING", False)
    assert "forgets" in (_run_dir(hstack, lease) / "tests.log").read_text()
    _close(hstack, docker_client, lease)


def test_compose_task_with_sidecar(hstack, docker_client):
    lease, _ = _reset(hstack, "harbor-compose-sidecar")
    services = {
        c.labels.get("com.docker.compose.service") for c in run_containers(docker_client, Store(hstack.redis), lease)
    }
    assert services == {"main", "kv"}
    _solve(hstack, lease, "harbor-compose-sidecar")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0
    _close(hstack, docker_client, lease)
