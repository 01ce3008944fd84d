"""Compose resolution once per task (environments/compose_cache.py): a run's model from the
task's template must equal what `docker compose config` gives for that run, for every task
shape; a template compose alters is never used; an edit of the task's files is seen at once.
Real compose (no dockerd needed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devstack import FIXTURES
from environments import compose_cache, compose_config
from environments.compose_cache import PLACEHOLDER_DIR, PLACEHOLDER_NAME, resolve_run, substitutable, substitute

pytestmark = pytest.mark.unit

TASKS = sorted(p.name for p in FIXTURES.iterdir() if (p / "docker-compose.yaml").is_file())


@pytest.fixture(autouse=True)
def empty_cache():
    compose_cache.clear()
    yield
    compose_cache.clear()


@pytest.fixture
def compose_calls(monkeypatch):
    """Counts the real compose runs made through the cache (each still runs compose)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[2])  # the project
        return compose_config.resolve(*args, **kwargs)

    monkeypatch.setattr(compose_cache, "resolve", counted)
    return calls


def make_env_for(task_name: str):
    def make_env(name: str, run_dir: Path) -> dict:
        return {**compose_config.compose_env(task_name, name, run_dir, f"tb__{task_name}__client"), "NO_PROXY": "x"}

    return make_env


def real(task_dir: Path, name: str, run_dir: Path) -> dict:
    files = ["-f", str(task_dir / "docker-compose.yaml")]
    return compose_config.resolve(task_dir, files, name, make_env_for(task_dir.name)(name, run_dir), 60)


def from_cache(task_dir: Path, name: str, run_dir: Path) -> dict:
    files = ["-f", str(task_dir / "docker-compose.yaml")]
    return resolve_run(task_dir, files, name, run_dir, make_env_for(task_dir.name), 60)


def test_substitute_replaces_in_strings_and_keys():
    value = {"a-X": ["X/y", {"k": "pre-X-X"}, 3, None, True], "n": 1.5}
    assert substitute(value, {"X": "run1"}) == {"a-run1": ["run1/y", {"k": "pre-run1-run1"}, 3, None, True], "n": 1.5}
    assert substitute(value, {}) == value and substitute(value, {}) is not value


@pytest.mark.parametrize(
    "name, run_dir, ok",
    [
        ("hello-file-r1a2", "/var/log/tp/hello-file/hello-file.0.r1a2", True),
        ("a_b-1", "/x", True),
        ("hello.v2-r1", "/x", False),  # compose refuses the name: resolved for real, refused the same way
        ("Hello-r1", "/x", False),
        ("ok-r1", "relative/dir", False),
        ("ok-r1", "/a/../b", False),
        ("ok-r1", "/a//b", False),
        ("ok-r1", "/a/b/", False),
        ("ok-r1", "/with space/r", False),
        ("ok-r1", "/colon:dir/r", False),
        ("ok-r1", "/dollar$x/r", False),
    ],
)
def test_only_plain_values_are_substituted(name, run_dir, ok):
    assert substitutable(name, run_dir) is ok
    assert substitutable(PLACEHOLDER_NAME, PLACEHOLDER_DIR)


@pytest.mark.parametrize("task", TASKS)
def test_every_task_shape_resolves_as_compose_does(task, tmp_path, compose_calls):
    task_dir = FIXTURES / task
    first, second = (tmp_path / "logs" / task / f"{task}.0.r{i}" for i in (1, 2))
    assert from_cache(task_dir, f"{task}-r1", first) == real(task_dir, f"{task}-r1", first)
    assert sorted(compose_calls) == sorted([f"{task}-r1", PLACEHOLDER_NAME])  # the run's own and the template
    assert from_cache(task_dir, f"{task}-r2", second) == real(task_dir, f"{task}-r2", second)
    assert len(compose_calls) == 2  # the second run came from the template


def test_a_template_that_does_not_hold_is_not_used(tmp_path, compose_calls):
    """A model that depends on more than the run's values as text: an optional env_file under
    the run folder, which exists for the real run and not for the placeholder folder."""
    task_dir = shutil.copytree(FIXTURES / "hello-file", tmp_path / "optional-env")
    compose = (task_dir / "docker-compose.yaml").read_text()
    (task_dir / "docker-compose.yaml").write_text(
        compose.replace(
            "    volumes:",
            "    env_file:\n      - path: ${T_BENCH_TASK_LOGS_PATH}/extra.env\n        required: false\n    volumes:",
        )
    )
    for i in (1, 2, 3):
        run_dir = tmp_path / "logs" / f"r{i}"
        (run_dir / "sessions").mkdir(parents=True)
        (run_dir / "sessions" / "extra.env").write_text(f"EXTRA={i}\n")
        model = from_cache(task_dir, f"optional-env-r{i}", run_dir)
        assert model == real(task_dir, f"optional-env-r{i}", run_dir)
        assert model["services"]["client"]["environment"]["EXTRA"] == str(i)
    assert compose_calls.count(PLACEHOLDER_NAME) == 1  # tried once, then every run resolved for real
    assert len(compose_calls) == 4


def test_a_path_compose_keeps_as_written_holds(tmp_path, compose_calls):
    """compose keeps `..` in an absolute bind source as written: the template holds."""
    task_dir = shutil.copytree(FIXTURES / "hello-file", tmp_path / "dotdot")
    compose = (task_dir / "docker-compose.yaml").read_text()
    (task_dir / "docker-compose.yaml").write_text(
        compose.replace("${T_BENCH_TASK_AGENT_LOGS_PATH}:", "${T_BENCH_TASK_AGENT_LOGS_PATH}/../../up:")
    )
    for i in (1, 2):
        run_dir = tmp_path / "logs" / f"r{i}"
        assert from_cache(task_dir, f"dotdot-r{i}", run_dir) == real(task_dir, f"dotdot-r{i}", run_dir)
    assert len(compose_calls) == 2  # r2 came from the template


def test_unusual_run_values_are_resolved_for_real(tmp_path, compose_calls):
    task_dir = FIXTURES / "hello-file"
    run_dir = tmp_path / "with space" / "r1"
    assert from_cache(task_dir, "hello-file-r1", run_dir) == real(task_dir, "hello-file-r1", run_dir)
    assert compose_calls == ["hello-file-r1"]


def test_an_edit_of_the_task_files_is_seen_at_once(tmp_path, compose_calls):
    task_dir = shutil.copytree(FIXTURES / "compose-env", tmp_path / "edited")
    first = from_cache(task_dir, "edited-r1", tmp_path / "r1")
    assert first["services"]["client"]["environment"]["FROM_ENV_FILE"] == "yes-from-env-file"
    (task_dir / "task.env").write_text("FROM_ENV_FILE=changed-value\n")  # an env_file: not a -f file
    second = from_cache(task_dir, "edited-r2", tmp_path / "r2")
    assert second["services"]["client"]["environment"]["FROM_ENV_FILE"] == "changed-value"
    assert second == real(task_dir, "edited-r2", tmp_path / "r2")
    compose = (task_dir / "docker-compose.yaml").read_text()
    (task_dir / "docker-compose.yaml").write_text(compose.replace("working_dir: /work", "working_dir: /elsewhere"))
    assert from_cache(task_dir, "edited-r3", tmp_path / "r3")["services"]["client"]["working_dir"] == "/elsewhere"
    assert compose_calls.count(PLACEHOLDER_NAME) == 3


def test_a_cached_model_is_a_copy(tmp_path):
    task_dir = FIXTURES / "hello-file"
    model = from_cache(task_dir, "hello-file-r1", tmp_path / "r1")
    model["services"]["client"]["command"].append("changed")
    model = from_cache(task_dir, "hello-file-r2", tmp_path / "r2")
    assert model["services"]["client"]["command"] == ["sh", "-c", "sleep infinity"]
    env = make_env_for("hello-file")("build", tmp_path)
    files = ["-f", str(task_dir / "docker-compose.yaml")]
    once = compose_cache.resolve_once(task_dir, files, "tb__hello-file", env, 60)
    once["services"].clear()
    assert compose_cache.resolve_once(task_dir, files, "tb__hello-file", env, 60)["services"]


def test_a_task_name_with_a_dot_gives_a_project_name_compose_takes(tmp_path):
    """A dot is fine in a container name but not in a compose project name (run_name is both)."""
    from environments.lifecycle import run_name

    name = run_name("Data.Pipeline v2", "run-0123456789abcdef")
    assert name == "data-pipeline-v2-run-0123456789abcdef"
    assert real(FIXTURES / "hello-file", name, tmp_path)["name"] == name
