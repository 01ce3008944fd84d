"""Tasks in Harbor's format (tests/fixtures/harbor/): loading, reward reading and whole episodes
(reset, a tool call, the reference solution, evaluate, close) on a stack of their own."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from cli.oracle import harbor_script
from devstack import ROOT
from environments import harbor_verifier
from poolcore.failures import RewardMissing
from poolcore.failures import TestsUnparsable as Unparsable
from poolcore.harbor_task import HarborTaskError, resolve_env
from poolcore.state import Store, warm_key
from poolcore.task_spec import TaskError, Unsupported, is_task_dir, load_task
from termpool.client import task_meta
from tests.conftest import private_stack, run_containers, wait_for

FIXTURES_ROOT = ROOT / "tests" / "fixtures"  # the stack's dataset: both formats (tasks/ and harbor/)
HARBOR = FIXTURES_ROOT / "harbor"
NAMES = [
    "harbor-hello",
    "harbor-partial",
    "harbor-no-reward",
    "harbor-compose-sidecar",
    "harbor-no-internet",
    "harbor-env",
    "harbor-prebuilt",
    "harbor-slow-build",
    "harbor-workdir",
    "harbor-agent-timeout",
]
HOST_VAR = "TP_HARBOR_FIXTURE_VAR"  # the one host variable harbor-env's templates may read
STACK_ENV = {"DATASET_DIR": str(FIXTURES_ROOT), "HARBOR_ENV_ALLOWLIST": HOST_VAR, HOST_VAR: "from-host"}


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
def test_storage_docker_image_and_steps(tmp_path):
    assert load_task(HARBOR / "harbor-hello").disk_limit_mb == 1024  # storage_mb
    assert load_task(_copy(tmp_path / "a", '[environment]\nstorage = "10G"\n')).disk_limit_mb == 10240
    assert load_task(_copy(tmp_path / "b", "")).disk_limit_mb is None
    with pytest.raises(TaskError, match="storage"):
        load_task(_copy(tmp_path / "c", '[environment]\nstorage = "ten"\n'))
    prebuilt = load_task(HARBOR / "harbor-prebuilt").harbor
    assert (prebuilt.docker_image, prebuilt.has_dockerfile) == ("termpool-harbor-prebuilt:fixture", False)
    with pytest.raises(Unsupported, match="multi-step"):
        load_task(HARBOR / "harbor-multi-step")  # [[steps]] and steps/


@pytest.mark.unit
def test_env_templates_read_only_allowed_host_variables():
    host = {"OK": "yes", "REDIS_URL": "redis://:secret@db"}
    env = {"A": "${OK}", "B": "${REDIS_URL:-d}", "C": "x ${OK}", "D": "${NOPE:-}", "E": "plain"}
    assert resolve_env(env, host, ("OK",)) == {"A": "yes", "B": "d", "C": "x ${OK}", "D": "", "E": "plain"}
    with pytest.raises(HarborTaskError, match="not in HARBOR_ENV_ALLOWLIST"):
        resolve_env({"A": "${REDIS_URL}"}, host, ("OK",))
    with pytest.raises(HarborTaskError, match="not set on this host"):
        resolve_env({"A": "${OK2}"}, host, ("OK2",))


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
    yield from private_stack(docker_client, STACK_ENV)


def harbor_try_reset(s, task: str):
    lease = s.client.allocate(task).id
    meta = task_meta(task, f"harbor/{task}")
    return lease, s.client.request("POST", "/reset", json={"lease_id": lease, "task_meta": meta})


def harbor_reset(s, task: str) -> tuple[str, dict]:
    lease, reply = harbor_try_reset(s, task)
    assert reply.status_code == 200, reply.text
    return lease, reply.json()


def harbor_sh(s, lease: str, command: str) -> str:
    return s.client.lease(lease).tool("shell_exec", id="main", command=command, block=True, timeout=60)


def harbor_solve(s, lease: str, task: str) -> str:
    """`dataset oracle`'s script (Harbor's oracle agent: solution/ at /solution, solve.sh with
    the [solution] env from the container's working directory) through the pool API; its output."""
    env = resolve_env(load_task(HARBOR / task).harbor.solution_env, s.env, (HOST_VAR,))
    outputs = [
        s.client.lease(lease).tool(call["name"], **call["arguments"]) for call in harbor_script(HARBOR / task, env, 60)
    ]
    return outputs[-1]


def harbor_close(s, docker_client, lease: str) -> None:
    assert s.client.request("POST", "/close", json={"lease_id": lease}).status_code == 200
    assert wait_for(lambda: not run_containers(docker_client, Store(s.redis), lease), 60), "teardown left containers"


def _run_dir(s, lease: str) -> Path:
    return Path(Store(s.redis).get_run(lease)["env"]["run_dir"])


def test_dockerfile_task_with_limits_and_hidden_tests(hstack, docker_client):
    lease, body = harbor_reset(hstack, "harbor-hello")
    assert body["user_msg"].endswith((HARBOR / "harbor-hello" / "instruction.md").read_text())
    assert harbor_sh(hstack, lease, "ls /tests 2>&1; ls /solution 2>&1; pwd").count("No such file") == 2
    [main] = run_containers(docker_client, Store(hstack.redis), lease)
    assert main.attrs["HostConfig"]["Memory"] == 512 * 1024**2  # task.toml's 512 MB < CONTAINER_MEMORY_LIMIT
    assert main.attrs["HostConfig"]["NanoCpus"] == 1_000_000_000
    # One service built from environment/: started without compose, as an original one-service task
    assert Store(hstack.redis).get_run(lease)["env"]["mode"] == "direct"
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 0.0
    harbor_solve(hstack, lease, "harbor-hello")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0
    verifier = _run_dir(hstack, lease) / "sessions"
    assert (verifier / "reward.txt").read_text().strip() == "1"
    assert "checked from /app as root; GREETING=hi" in (verifier / "test-stdout.txt").read_text()
    assert json.loads((_run_dir(hstack, lease) / "results.json").read_text())["rewards"] == {"reward": 1.0}
    harbor_close(hstack, docker_client, lease)


def test_reward_json_non_binary(hstack, docker_client):
    lease, _ = harbor_reset(hstack, "harbor-partial")
    harbor_solve(hstack, lease, "harbor-partial")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200, reply.text
    assert reply.json()["score"] == pytest.approx(2 / 3)  # test.sh exits 1: ignored
    record = Store(hstack.redis).get_run(lease)
    assert record["rewards"] == {"reward": pytest.approx(2 / 3), "lines": 3.0}
    harbor_close(hstack, docker_client, lease)


def test_no_reward_file_is_reward_missing(hstack, docker_client):
    lease, _ = harbor_reset(hstack, "harbor-no-reward")
    assert harbor_sh(hstack, lease, "echo hi").strip() == "hi"
    harbor_solve(hstack, lease, "harbor-no-reward")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 500
    body = reply.json()
    assert (body["code"], body["retryable"]) == ("REWARD_MISSING", False)
    assert "forgets" in (_run_dir(hstack, lease) / "tests.log").read_text()
    harbor_close(hstack, docker_client, lease)


def test_compose_task_with_sidecar(hstack, docker_client):
    lease, _ = harbor_reset(hstack, "harbor-compose-sidecar")
    services = {
        c.labels.get("com.docker.compose.service") for c in run_containers(docker_client, Store(hstack.redis), lease)
    }
    assert services == {"main", "kv"}
    harbor_solve(hstack, lease, "harbor-compose-sidecar")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0
    harbor_close(hstack, docker_client, lease)


PROBE = (
    "python3 -c \"import urllib.request; urllib.request.urlopen('http://deb.debian.org/debian/', timeout=10)\" 2>/dev/null"
    " && echo reached || echo unreachable"
)


def test_no_internet_episode(hstack, docker_client):
    """allow_internet = false: main has no network (Harbor's no-network file); an ordinary
    Harbor task's container reaches the same outside address."""
    online, _ = harbor_reset(hstack, "harbor-hello")
    assert harbor_sh(hstack, online, PROBE).strip() == "reached"  # the control: the address answers
    harbor_close(hstack, docker_client, online)
    lease, _ = harbor_reset(hstack, "harbor-no-internet")
    assert harbor_sh(hstack, lease, PROBE).strip() == "unreachable"
    assert harbor_sh(hstack, lease, "ls /sys/class/net").split() == ["lo"]
    [main] = run_containers(docker_client, Store(hstack.redis), lease)
    assert main.attrs["HostConfig"]["NetworkMode"] == "none"
    harbor_solve(hstack, lease, "harbor-no-internet")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    harbor_close(hstack, docker_client, lease)


def test_build_past_build_timeout_sec(hstack, docker_client):
    started = time.monotonic()
    since = time.time()
    lease, reply = harbor_try_reset(hstack, "harbor-slow-build")  # RUN sleep 120, build_timeout_sec = 3
    assert reply.status_code == 500, reply.text
    body = reply.json()
    assert (body["code"], body["retryable"]) == ("TASK_BUILD_FAILED", False), body
    assert "build_timeout_sec" in body["error"] and time.monotonic() - started < 60
    harbor_close(hstack, docker_client, lease)
    assert wait_for(lambda: not _builds_since(docker_client, since), 15), "the abandoned build runs on"


def _builds_since(docker_client, since: float) -> list[str]:
    """Containers of harbor-slow-build's RUN step created since `since` (older ones may be
    builds Harbor's own Docker environment left running in another test). Every container of
    the daemon is listed: one another test file removes meanwhile is skipped, not an error."""
    found = []
    for container in docker_client.containers.list(ignore_removed=True):
        created = datetime.fromisoformat(container.attrs["Created"][:26].rstrip("Z") + "+00:00").timestamp()
        if "sleep 120" in " ".join(container.attrs["Config"]["Cmd"] or []) and created >= since - 1:
            found.append(container.id)
    return found


@pytest.mark.parametrize(
    "task, words",
    [("harbor-multi-step", "multi-step"), ("harbor-prebuilt", "TBENCH_DOCKER_IMAGE_SOURCE=build")],
)
def test_refused_with_task_unsupported(hstack, docker_client, task, words):
    """steps/ (multi-step tasks), and a docker_image without a Dockerfile in a pool that builds."""
    lease, reply = harbor_try_reset(hstack, task)
    body = reply.json()
    assert reply.status_code in (400, 500) and body["code"] == "TASK_UNSUPPORTED", reply.text
    assert words in body["error"] and body["retryable"] is False
    assert run_containers(docker_client, Store(hstack.redis), lease) == []
    harbor_close(hstack, docker_client, lease)


def test_env_templates(hstack, docker_client):
    """${VAR} from an allowed host variable, ${VAR:-default} for any other (REDIS_URL is the
    worker's own), a template inside a longer value literal; [solution] env as the oracle's."""
    lease, _ = harbor_reset(hstack, "harbor-env")
    harbor_solve(hstack, lease, "harbor-env")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    out = (_run_dir(hstack, lease) / "sessions" / "test-stdout.txt").read_text()
    assert out.strip() == "FROM_HOST=from-host LEAK=not passed PLAIN=a ${X} b ANSWER=from-host"
    harbor_close(hstack, docker_client, lease)


def test_shell_sessions_start_where_harbor_exec_starts(hstack, docker_client):
    """A Harbor task's shell sessions start where Harbor's exec does: [environment] workdir, else
    the image's WORKDIR; relative file paths lead there too. The original format keeps /workspace."""
    lease, _ = harbor_reset(hstack, "harbor-workdir")
    assert harbor_sh(hstack, lease, "pwd").strip() == "/srv/task"
    hstack.client.lease(lease).tool("shell_write_content_to_file", content="x", file_path="note.txt")
    assert harbor_sh(hstack, lease, "cat /srv/task/note.txt").strip() == "x"
    harbor_solve(hstack, lease, "harbor-workdir")  # solve.sh writes result.txt relative to where it runs
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    harbor_close(hstack, docker_client, lease)
    lease, _ = harbor_reset(hstack, "harbor-hello")  # no workdir: the image's WORKDIR
    assert harbor_sh(hstack, lease, "pwd").strip() == "/app"
    harbor_close(hstack, docker_client, lease)
    lease = hstack.client.allocate("hello-file").id  # the original format: the reference's /workspace
    meta = task_meta("hello-file", "tasks/hello-file")
    assert hstack.client.request("POST", "/reset", json={"lease_id": lease, "task_meta": meta}).status_code == 200
    assert harbor_sh(hstack, lease, "pwd").strip() == "/workspace"
    harbor_close(hstack, docker_client, lease)


def test_oracle_over_a_mixed_dataset(hstack, tmp_path, monkeypatch):
    """`dataset oracle` runs both formats: solution.sh, and Harbor's solution/ as its oracle agent."""
    from tests.test_dataset_cli import cli

    monkeypatch.setenv(HOST_VAR, "from-host")  # the CLI resolves [solution] env in its own process
    run = cli(tmp_path, **STACK_ENV)
    report = tmp_path / "oracle.json"
    tasks = ["tasks/hello-file", "harbor/harbor-hello", "harbor/harbor-env", "harbor/harbor-partial"]
    result = run("oracle", "--url", hstack.url, "-j", "2", *[a for t in tasks for a in ("-t", t)], "--report", report)
    by_task = {t["task"]: t for t in json.loads(report.read_text())["tasks"]}
    assert not [t["error"] for t in by_task.values() if t["error"]], by_task
    assert result.exit_code == 1, result.output  # harbor-partial scores 2/3
    assert {t: by_task[t]["reward"] for t in tasks} == {
        "tasks/hello-file": 1.0,
        "harbor/harbor-hello": 1.0,  # solve.sh writes hello.txt in the working directory (/app)
        "harbor/harbor-env": 1.0,
        "harbor/harbor-partial": pytest.approx(2 / 3),
    }


def test_warm_spares_of_a_dockerfile_task(hstack, docker_client):
    """A Harbor task with only a Dockerfile is pooled like an original one-service task: a
    reset asks for a spare, the next reset takes it, and the run on it is a whole episode
    (limits, hidden tests, the reward file among the run's artifacts). A compose task is not."""
    first, _ = harbor_reset(hstack, "harbor-hello")
    key = warm_key(hstack.host_id, "harbor/harbor-hello")
    assert wait_for(lambda: hstack.redis.llen(key) >= 1, 90), "a reset left no spare"
    lease, _ = harbor_reset(hstack, "harbor-hello")
    env = Store(hstack.redis).get_run(lease)["env"]
    assert env["warm_id"] and env["mode"] == "direct", env
    [main] = run_containers(docker_client, Store(hstack.redis), lease)
    assert main.labels["termpool.run"] == env["warm_id"]
    assert (main.attrs["HostConfig"]["Memory"], main.attrs["HostConfig"]["NanoCpus"]) == (512 * 1024**2, 10**9)
    assert harbor_sh(hstack, lease, "ls /tests 2>&1").count("No such file") == 1
    harbor_solve(hstack, lease, "harbor-hello")
    reply = hstack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    assert (_run_dir(hstack, lease) / "sessions" / "reward.txt").read_text().strip() == "1"
    for done in (first, lease):
        harbor_close(hstack, docker_client, done)
    sidecar, _ = harbor_reset(hstack, "harbor-compose-sidecar")
    time.sleep(5)  # a refill would have been sent with the reset
    assert hstack.redis.llen(warm_key(hstack.host_id, "harbor/harbor-compose-sidecar")) == 0
    harbor_close(hstack, docker_client, sidecar)
