"""`flask --app app dataset ...`: check, download (from a local git origin), prebuild and
oracle (against the session stack), driven through Flask's CLI runner."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from cli import download as dl
from devstack import FIXTURES
from poolcore.config import load_settings
from tests.conftest import make_app


def cli(tmp_path: Path, **env):
    """A CLI runner over an app whose settings come from env (not the test process's)."""
    settings = {
        "DATASET_DIR": str(FIXTURES),
        "TBENCH_OUTPUT_ROOT": str(tmp_path / "out"),
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "POOL_HOST_ID": "cli-test",
        "REGISTRY_URL": "off",  # each test its own pool: another test's push must not serve it
        **env,
    }
    app = make_app(settings)
    runner = app.test_cli_runner()
    return lambda *args, **kw: runner.invoke(args=["dataset", *map(str, args)], catch_exceptions=False, **kw)


# ---- check --------------------------------------------------------------------------------
@pytest.mark.unit
def test_check_fixtures_are_clean(tmp_path):
    result = cli(tmp_path)("check")
    assert result.exit_code == 0, result.output
    tasks = sum(1 for d in FIXTURES.iterdir() if d.is_dir())
    assert f"{tasks} tasks checked" in result.stdout and f"{tasks} clean, 0 with problems" in result.stdout


@pytest.mark.unit
def test_check_lists_problems(tmp_path):
    data = tmp_path / "ds"
    data.mkdir()
    shutil.copytree(FIXTURES / "hello-file", data / "hello-file")
    broken = shutil.copytree(FIXTURES / "hello-file", data / "broken-task")
    (broken / "task.yaml").write_text("difficulty: easy\n")  # no instruction
    (broken / "run-tests.sh").unlink()
    (broken / "Dockerfile").unlink()
    (data / "stray").mkdir()  # not a task at all
    (data / "hello-file" / "weights.json").write_text("{not json")  # termpool does not read weights
    run = cli(tmp_path)

    result = run("check", data)
    assert result.exit_code == 1, result.output
    rows = [line.split(None, 1) for line in result.stdout.splitlines()]
    problems = {(row[0], row[1]) for row in rows if len(row) == 2 and row[0] in ("broken-task", "stray")}
    assert ("broken-task", "the required key 'instruction' is missing") in problems
    assert ("broken-task", "no run-tests.sh (the grader)") in problems
    assert ("broken-task", "service 'client': no Dockerfile (its build context)") in problems
    assert ("stray", "no task.yaml") in problems
    assert "3 tasks checked" in result.stdout and "1 clean, 2 with problems" in result.stdout

    result = run("check", data, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["tasks"] == 3 and report["tasks_with_problems"] == 2
    assert not [p for p in report["problems"] if p["task"] == "hello-file"]
    assert {"task": "broken-task", "problem": "no run-tests.sh (the grader)"} in report["problems"]


@pytest.mark.unit
def test_check_flags_what_termpool_refuses_or_cannot_honour(tmp_path):
    """The same rules the start path applies (environments/compose_config.py), before any run."""
    from tests.test_unsafe_tasks import CLIENT

    extra = {
        "privileged": "    privileged: true\n",
        "socket": "    volumes: [ '/var/run:/host-run' ]\n",
        "caps": "    cap_add: [ ALL ]\n",
        "host-net": "    network_mode: host\n",
        "host-pid": "    pid: host\n",
        "devices": "    devices: [ '/dev/kmsg:/dev/kmsg' ]\n",
        "unset-var": "    environment: [ 'X=${TP_CHECK_UNSET:?TP_CHECK_UNSET is required}' ]\n",
        "outside": "  side:\n    build: ../elsewhere\n",
        "ports": "    ports: [ '8080:80' ]\n",
        "host-path": "    volumes: [ '/etc:/host-etc:ro' ]\n",
    }
    data = tmp_path / "ds"
    for name, text in extra.items():
        task = shutil.copytree(FIXTURES / "hello-file", data / name)
        (task / "docker-compose.yaml").write_text(CLIENT + text)
    (tmp_path / "elsewhere").mkdir()
    result = cli(tmp_path)("check", data, "--json")
    assert result.exit_code == 1, result.output
    found = {}
    for problem in json.loads(result.stdout)["problems"]:
        found.setdefault(problem["task"], []).append(problem["problem"])
    expected = {
        "privileged": "asks to be privileged",
        "socket": "may not mount the Docker socket",
        "caps": "capability ALL",
        "host-net": "network_mode: host",
        "host-pid": "pid: host",
        "devices": "host devices",
        "unset-var": "TP_CHECK_UNSET is required",
        "outside": "outside the task directory",
        "ports": "publishes host port 8080",
        "host-path": "bind-mounts the host path /etc",
    }
    for task, words in expected.items():
        assert any(words in p for p in found.get(task, [])), (task, found.get(task))
    assert found["unset-var"][0].startswith("docker-compose.yaml: ")


# ---- download -----------------------------------------------------------------------------
def git(*args, cwd):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


def commit_all(repo: Path) -> None:
    """Make `repo` a git repository whose one commit holds every file in it (a download's origin)."""
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "tasks", cwd=repo)


@pytest.fixture
def origin(tmp_path) -> Path:
    """A local repository laid out like terminal-bench: tasks/<task>/, plus other folders."""
    repo = tmp_path / "origin"
    for task in ("alpha", "beta"):
        shutil.copytree(FIXTURES / "hello-file", repo / "tasks" / task)
    (repo / "docs").mkdir()
    (repo / "docs" / "README.md").write_text("not a task\n")
    commit_all(repo)
    return repo


@pytest.mark.unit
def test_download_sparse_from_local_origin(tmp_path, origin):
    dest = tmp_path / "datasets"
    run = cli(tmp_path)
    result = run("download", "tbench_core", "--origin", origin, "--dest", dest)
    assert result.exit_code == 0, result.output
    target = dest / "tbench_core"
    assert sorted(p.name for p in target.iterdir()) == [".termpool-source.json", "alpha", "beta"]
    assert (target / "alpha" / "task.yaml").is_file() and not (dest / "docs").exists()
    source = json.loads((target / ".termpool-source.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=origin, capture_output=True, text=True).stdout.strip()
    assert source["commit"] == head and source["subdir"] == "tasks"
    assert [p.name for p in dest.iterdir()] == ["tbench_core"]  # no work folders left
    assert run("check", target).exit_code == 0

    again = run("download", "tbench_core", "--origin", origin, "--dest", dest)
    assert again.exit_code == 0 and "already exists" in again.output

    # Origin and branch from the settings; a missing folder is a clear error (exit 2).
    env = {
        "TERMPOOL_DATASET_TBENCH_TEST_ORIGIN": str(origin),
        "TERMPOOL_DATASET_TBENCH_TEST_REF": "main",
        "TERMPOOL_DATASET_TBENCH_TEST_SUBDIR": "nope",
    }
    result = cli(tmp_path, **env)("download", "tbench_test", "--dest", dest)
    assert result.exit_code == 2 and "has no folder nope" in result.output
    assert [p.name for p in dest.iterdir()] == ["tbench_core"]


@pytest.mark.unit
def test_source_overrides_come_from_the_settings_and_options_win():
    cfg = load_settings({"TERMPOOL_DATASET_TBENCH_CORE_REF": " ", "TERMPOOL_DATASET_TBENCH_CORE_SUBDIR": "a, b/"})
    overrides = cfg.dataset_sources["tbench_core"]
    source = dl.resolve_source("tbench_core", overrides=overrides)
    assert source.ref == ""  # set but empty: the origin's default branch
    assert source.subdirs == ("a", "b") and source.origin == dl.DATASETS["tbench_core"].origin
    source = dl.resolve_source("tbench_core", ref="v1", subdir="c", overrides=overrides)
    assert (source.ref, source.subdirs) == ("v1", ("c",))
    assert (
        dl.resolve_source("tbench_test", overrides=cfg.dataset_sources.get("tbench_test")) == dl.DATASETS["tbench_test"]
    )


# ---- prebuild -----------------------------------------------------------------------------
def test_prebuild_reports_built_and_failed(tmp_path, base_image, docker_client, redis_server):
    data = tmp_path / "ds"
    name = f"prebuild-{uuid.uuid4().hex[:8]}"  # a fresh image, so something is really built
    shutil.copytree(FIXTURES / "hello-file", data / name)
    shutil.copytree(FIXTURES / "broken-dockerfile", data / "broken-dockerfile")
    port = redis_server.connection_pool.connection_kwargs["port"]
    run = cli(tmp_path, REDIS_URL=f"redis://127.0.0.1:{port}/0")
    try:
        result = run("prebuild", data, "--hosts", "here", "-j", "2", "--json")
        assert result.exit_code == 1, result.output
        report = json.loads(result.stdout)
        by_task = {t["task"]: t for t in report["tasks"]}
        assert report["built"] == 1 and report["failed"] == 1
        assert by_task[name]["status"] == "built" and by_task[name]["image"] == f"tb__{name}__client"
        assert by_task["broken-dockerfile"]["status"] == "failed"
        assert "exit 3" in by_task["broken-dockerfile"]["error"]
        docker_client.images.get(f"tb__{name}__client")
    finally:
        try:
            docker_client.images.remove(f"tb__{name}__client", force=True)
        except Exception:
            pass


@pytest.mark.unit
def test_prebuild_needs_redis(tmp_path):
    result = cli(tmp_path)("prebuild", FIXTURES)
    assert result.exit_code == 2 and "is needed for the build locks" in result.output


# ---- oracle -------------------------------------------------------------------------------
def test_oracle_over_fixtures(tmp_path, stack):
    run = cli(tmp_path)
    report_path = tmp_path / "oracle.json"
    result = run(
        "oracle",
        "--url",
        stack.url,
        "-j",
        "3",
        "-t",
        "hello-file",
        "-t",
        "partial-pass",
        "-t",
        "broken-dockerfile",
        "--report",
        report_path,
    )
    assert result.exit_code == 1, result.output  # not everything scores 1.0
    report = json.loads(report_path.read_text())
    by_task = {t["task"]: t for t in report["tasks"]}
    assert by_task["hello-file"]["outcome"] == "passed" and by_task["hello-file"]["reward"] == 1.0
    assert by_task["partial-pass"]["outcome"] == "partial" and by_task["partial-pass"]["reward"] == 0.75
    assert by_task["broken-dockerfile"]["outcome"] == "error" and by_task["broken-dockerfile"]["reward"] is None
    assert "exit 3" in by_task["broken-dockerfile"]["error"]
    assert by_task["broken-dockerfile"]["code"] == "TASK_BUILD_FAILED" and by_task["hello-file"]["code"] == ""
    assert report["summary"] == {
        "tasks": 3,
        "passed": 1,
        "partial": 1,
        "failed": 0,
        "errors": 1,
        "skipped": 0,
        "mean_reward": 0.875,
        "errors_by_code": {"TASK_BUILD_FAILED": 1},
    }
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["partial-pass", "partial", "0.75"] for line in lines if line.strip())
    assert any(
        line.split()[:2] == ["broken-dockerfile", "error"] and "TASK_BUILD_FAILED" in line.split() for line in lines
    )
    assert "Errors by code: TASK_BUILD_FAILED 1" in result.stdout
    # Every run was closed: nothing of the oracle holds capacity.
    status = stack.get("/status").json()["pool"]["tasks"]
    assert not {"hello-file", "partial-pass", "broken-dockerfile"} & set(status)
