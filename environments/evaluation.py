"""Run a task's tests in its client container and score them (docs/task-format.md, step 4).

Two steps, so a caller can retry the first: copying the tests in changes nothing the tests
look at; running them may (they are the task's code).
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from environments import kept_result
from environments.session_helper import HELPER_PATH
from poolcore.failures import DockerError, TaskInvalid, TestsTimeout, TestsUnparsable
from poolcore.pytest_parser import UnknownParser, get_parser, score
from poolcore.task_spec import TaskSpec

TESTS_DIR = "/tests"
TIMED_OUT = 124


@dataclass
class Evaluation:
    output: str
    tests: dict
    score: float
    rewards: dict | None = None  # a Harbor task's named rewards (environments/harbor_verifier.py)


def tests_archive(task_dir: Path) -> bytes:
    """run-tests.sh plus the contents of tests/, laid out as /tests expects."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(task_dir / "run-tests.sh", arcname="tests/run-tests.sh")
        tests = task_dir / "tests"
        if tests.is_dir():
            for item in sorted(tests.iterdir()):
                tar.add(item, arcname=f"tests/{item.name}")
    return buf.getvalue()


def _parser(spec: TaskSpec):
    try:
        return get_parser(spec.parser_name)
    except UnknownParser as exc:
        raise TaskInvalid(str(exc)) from None


def copy_tests(container, task_dir: Path, spec: TaskSpec) -> None:
    """Put run-tests.sh and tests/ at /tests; an unknown parser fails before anything is copied."""
    _parser(spec)
    if not container.put_archive("/", tests_archive(task_dir)):
        raise DockerError("could not copy the tests into the container")


def run_tests(container, spec: TaskSpec, eval_timeout: float) -> Evaluation:
    """Run the copied tests within their budget and parse their output.

    TestsTimeout / TestsUnparsable carry the output, for the run's artifacts.
    """
    parser = _parser(spec)
    budget = spec.test_time_limit(eval_timeout)
    result = kept_result.run(
        container,
        [HELPER_PATH, "run-timeout", f"{budget:g}", "--", "bash", f"{TESTS_DIR}/run-tests.sh"],
        user="root",
        environment={"TEST_DIR": TESTS_DIR},
        limit=budget + kept_result.SLACK_SECONDS,
    )
    output = (result.output or b"").decode("utf-8", errors="replace")
    if result.exit_code == TIMED_OUT:
        raise TestsTimeout(f"tests timed out: they did not finish within {budget:g} s", output)
    try:
        tests = parser(output)
    except ValueError as exc:
        raise TestsUnparsable(f"test output could not be parsed: {exc}", output) from None
    return Evaluation(output=output, tests=tests, score=score(tests))
