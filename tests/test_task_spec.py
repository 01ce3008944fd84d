"""Reading task directories (docs/task-format.md), including every fixture task."""

from pathlib import Path

import pytest
import yaml

from poolcore.task_spec import (
    NoGrader,
    TaskError,
    TaskSpec,
    compose_file,
    image_name,
    load_task,
    load_task_cached,
    name_prefix,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
FIXTURE_NAMES = [
    "hello-file",
    "sidecar-kv",
    "interactive-guess",
    "partial-pass",
    "broken-dockerfile",
    "slow-tests",
    "slow-build",
    "compose-limits",
    "compose-healthy-sidecar",
    "compose-env",
    "compose-agent-service",
    "compose-agent-alone",
    "compose-volumes",
    "redis-db-sidecar",
    "nginx-sshd-services",
    "compose-dockerfile-names",
    "fifo-repl",
    "tmux-detached",
    "compose-fixed-subnet",
    "compose-counter",
    "two-service-small",
]


def make_task(tmp_path, yaml_text, *, name="my-task", run_tests=True):
    task = tmp_path / name
    task.mkdir()
    if yaml_text is not None:
        (task / "task.yaml").write_text(yaml_text)
    if run_tests:
        (task / "run-tests.sh").write_text("#!/bin/bash\npython3 -m pytest $TEST_DIR/test_outputs.py -rA\n")
    return task


def test_minimal_task_gets_defaults(tmp_path):
    spec = load_task(make_task(tmp_path, "instruction: do it\n"))
    assert isinstance(spec, TaskSpec)
    assert spec.name == "my-task"
    assert spec.instruction == "do it"
    assert spec.parser_name == "pytest"
    assert spec.max_agent_timeout_sec == 360
    assert spec.max_test_timeout_sec == 60
    assert spec.path == tmp_path / "my-task"


def test_full_task(tmp_path):
    text = """\
instruction: |-
  Line one.
  Line two.
difficulty: hard
parser_name: pytest
max_agent_timeout_sec: 900
max_test_timeout_sec: 120.5
run_tests_in_same_shell: true
author_name: Ada
author_email: ada@example.com
category: security
tags: [a, b]
disable_asciinema: true
estimated_duration_sec: 30
expert_time_estimate_min: 5
junior_time_estimate_min: 20
some_future_key: {nested: 1}
"""
    spec = load_task(make_task(tmp_path, text))
    assert spec.instruction == "Line one.\nLine two."
    assert spec.max_agent_timeout_sec == 900.0
    assert spec.max_test_timeout_sec == 120.5


def test_nulls_mean_defaults(tmp_path):
    text = "instruction: x\ndifficulty:\nparser_name:\nmax_agent_timeout_sec:\nmax_test_timeout_sec: null\nrun_tests_in_same_shell:\n"
    spec = load_task(make_task(tmp_path, text))
    assert (spec.parser_name, spec.max_agent_timeout_sec, spec.max_test_timeout_sec) == ("pytest", 360, 60)


def test_numeric_strings_are_accepted(tmp_path):
    spec = load_task(
        make_task(tmp_path, "instruction: x\nmax_test_timeout_sec: '30'\nrun_tests_in_same_shell: 'false'\n")
    )
    assert spec.max_test_timeout_sec == 30.0


def test_other_parser_name_is_kept_for_a_clear_error_at_evaluation(tmp_path):
    assert load_task(make_task(tmp_path, "instruction: x\nparser_name: swebench\n")).parser_name == "swebench"


def test_test_time_limit(tmp_path):
    spec = load_task(make_task(tmp_path, "instruction: x\nmax_test_timeout_sec: 2\n"))
    assert spec.test_time_limit(600) == 8
    assert spec.test_time_limit(5) == 5


def test_old_descriptions_format(tmp_path):
    text = "descriptions:\n  - key: base\n    description: from the old format\n"
    assert load_task(make_task(tmp_path, text)).instruction == "from the old format"


# --- errors ---------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_task(tmp_path / "nope")


def test_missing_task_yaml(tmp_path):
    with pytest.raises(TaskError, match="no task.yaml"):
        load_task(make_task(tmp_path, None))


def test_invalid_yaml(tmp_path):
    with pytest.raises(TaskError, match="invalid YAML"):
        load_task(make_task(tmp_path, "instruction: [unclosed\n"))


def test_not_utf8(tmp_path):
    task = make_task(tmp_path, None)
    (task / "task.yaml").write_bytes(b"instruction: \xff\xfe\n")
    with pytest.raises(TaskError, match="cannot read"):
        load_task(task)


@pytest.mark.parametrize("text", ["", "# just a comment\n"])
def test_empty_task_yaml(tmp_path, text):
    with pytest.raises(TaskError, match="empty"):
        load_task(make_task(tmp_path, text))


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_task_yaml_not_a_mapping(tmp_path, text):
    with pytest.raises(TaskError, match="mapping"):
        load_task(make_task(tmp_path, text))


def test_missing_instruction(tmp_path):
    with pytest.raises(TaskError, match="'instruction' is missing"):
        load_task(make_task(tmp_path, "difficulty: easy\n"))


@pytest.mark.parametrize("value", ["42", "[a, b]", "{a: 1}", "true"])
def test_instruction_not_a_string(tmp_path, value):
    with pytest.raises(TaskError, match="must be a string"):
        load_task(make_task(tmp_path, f"instruction: {value}\n"))


def test_blank_instruction(tmp_path):
    with pytest.raises(TaskError, match="empty"):
        load_task(make_task(tmp_path, "instruction: '   '\n"))


def test_missing_run_tests(tmp_path):
    with pytest.raises(NoGrader, match="run-tests.sh"):
        load_task(make_task(tmp_path, "instruction: x\n", run_tests=False))


@pytest.mark.parametrize(
    "line",
    [
        "max_test_timeout_sec: 0",
        "max_test_timeout_sec: -5",
        "max_test_timeout_sec: soon",
        "max_test_timeout_sec: true",
        "max_test_timeout_sec: [1]",
        "max_agent_timeout_sec: .nan",
        "max_agent_timeout_sec: .inf",
    ],
)
def test_bad_timeouts(tmp_path, line):
    key = line.split(":")[0]
    with pytest.raises(TaskError, match=key):
        load_task(make_task(tmp_path, f"instruction: x\n{line}\n"))


@pytest.mark.parametrize("value", ["maybe", "2", "[true]"])
def test_bad_run_tests_in_same_shell(tmp_path, value):
    with pytest.raises(TaskError, match="run_tests_in_same_shell"):
        load_task(make_task(tmp_path, f"instruction: x\nrun_tests_in_same_shell: {value}\n"))


@pytest.mark.parametrize("value", ["''", "[pytest]", "3"])
def test_bad_parser_name(tmp_path, value):
    with pytest.raises(TaskError, match="parser_name"):
        load_task(make_task(tmp_path, f"instruction: x\nparser_name: {value}\n"))


def test_task_error_is_value_error():
    assert issubclass(TaskError, ValueError)


# --- compose file, names -----------------------------------------------------


def test_compose_file_yaml_preferred(tmp_path):
    task = make_task(tmp_path, "instruction: x\n")
    with pytest.raises(TaskError, match="docker-compose"):
        compose_file(task)
    (task / "docker-compose.yml").write_text("services: {}\n")
    assert compose_file(task) == task / "docker-compose.yml"
    (task / "docker-compose.yaml").write_text("services: {}\n")
    assert compose_file(task) == task / "docker-compose.yaml"


@pytest.mark.parametrize(
    "task, image, prefix",
    [
        ("hello-file", "tb__hello-file__client", "tb__hello-file"),
        ("fix.git.v2", "tb__fix-git-v2__client", "tb__fix-git-v2"),
        ("My_Task", "tb__my_task__client", "tb__my_task"),
        ("odd name+1", "tb__odd-name-1__client", "tb__odd-name-1"),
    ],
)
def test_image_and_prefix_names(task, image, prefix):
    assert image_name(task) == image
    assert name_prefix(task) == prefix


@pytest.mark.parametrize("bad", ["", "  ", None])
def test_names_need_a_task_name(bad):
    with pytest.raises(TaskError):
        image_name(bad)


# --- the fixture tasks ----------------------------------------------------------------


def test_fixture_set_is_complete():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(FIXTURE_NAMES)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_loads(name):
    task = FIXTURES / name
    spec = load_task(task)
    assert spec.name == name
    assert spec.instruction.strip()
    assert spec.parser_name == "pytest"
    meta = yaml.safe_load((task / "task.yaml").read_text())
    assert meta.get("run_tests_in_same_shell", False) is False
    assert meta.get("difficulty", "unknown") in ("easy", "medium", "hard", "unknown")
    assert meta["author_name"] and meta["category"] and "fixture" in meta["tags"]
    for needed in ("Dockerfile", "solution.sh", "tests/test_outputs.py"):
        assert (task / needed).is_file(), needed
    assert "-rA" in (task / "run-tests.sh").read_text()
    assert (task / "run-tests.sh").stat().st_mode & 0o111
    assert (task / "solution.sh").stat().st_mode & 0o111


TEMPLATE_FIXTURES = [name for name in FIXTURE_NAMES if not name.startswith("compose-")]  # compose-*: features


@pytest.mark.parametrize("name", TEMPLATE_FIXTURES)
def test_fixture_compose_and_dockerfile(name):
    task = FIXTURES / name
    compose = yaml.safe_load(compose_file(task).read_text())
    client = compose["services"]["client"]
    assert client["image"] == "${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}"
    assert client["container_name"] == "${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}"
    assert client["environment"] == ["TEST_DIR=${T_BENCH_TEST_DIR}"]
    assert client["volumes"] == [
        "${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}",
        "${T_BENCH_TASK_AGENT_LOGS_PATH}:${T_BENCH_CONTAINER_AGENT_LOGS_PATH}",
    ]
    dockerfile = (task / "Dockerfile").read_text()
    assert dockerfile.startswith("FROM termpool-test-base:bookworm\n")
    assert "WORKDIR /app" in dockerfile


def test_fixture_specifics():
    assert load_task(FIXTURES / "slow-tests").max_test_timeout_sec == 2
    assert load_task(FIXTURES / "slow-tests").test_time_limit(600) == 8
    assert "exit 3" in (FIXTURES / "broken-dockerfile" / "Dockerfile").read_text()
    sidecar = yaml.safe_load((FIXTURES / "sidecar-kv" / "docker-compose.yaml").read_text())
    assert set(sidecar["services"]) == {"client", "kv"}
    assert (FIXTURES / "sidecar-kv" / "kv" / "Dockerfile").is_file()
    assert (FIXTURES / "interactive-guess" / "guess").stat().st_mode & 0o111
    partial = (FIXTURES / "partial-pass" / "tests" / "test_outputs.py").read_text()
    assert partial.count("\ndef test_") == 4


def test_a_cached_spec_is_read_again_when_its_task_changes(tmp_path):
    task = make_task(tmp_path, "instruction: first\n")
    first = load_task_cached(task)
    assert first.instruction == "first" and load_task_cached(task) is first
    (task / "task.yaml").write_text("instruction: second, and longer\n")
    assert load_task_cached(task).instruction == "second, and longer"
    replaced = tmp_path / "new.yaml"
    replaced.write_text("instruction: SECOND, and longer\n")
    replaced.replace(task / "task.yaml")  # same size as before: a new file all the same
    assert load_task_cached(task).instruction == "SECOND, and longer"
    (task / "run-tests.sh").unlink()
    with pytest.raises(NoGrader):
        load_task_cached(task)
    (task / "task.yaml").unlink()
    with pytest.raises(TaskError, match="no task.yaml"):
        load_task_cached(task)
