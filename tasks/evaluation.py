"""Run a task's tests in its client container and score them (TASK_FORMAT.md, step 4)."""
from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tasks.session_helper import HELPER_PATH
from termpool.pytest_parser import get_parser, score
from termpool.task_spec import TaskSpec

TESTS_DIR = "/tests"
TIMED_OUT = 124


class EvaluationError(RuntimeError):
    """The tests ran but gave no score; carries their output for the run's artifacts."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


@dataclass
class Evaluation:
    output: str
    tests: dict
    score: float


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


def test_budget(spec: TaskSpec, eval_timeout: float) -> float:
    return min(eval_timeout, 4 * float(spec.max_test_timeout_sec))


def run_tests(container, task_dir: Path, spec: TaskSpec, eval_timeout: float) -> Evaluation:
    parser = get_parser(spec.parser_name)  # an unknown parser fails before anything runs
    if not container.put_archive("/", tests_archive(task_dir)):
        raise RuntimeError("could not copy the tests into the container")
    budget = test_budget(spec, eval_timeout)
    result = container.exec_run(
        [HELPER_PATH, "run-timeout", f"{budget:g}", "--", "bash", f"{TESTS_DIR}/run-tests.sh"],
        user="root", environment={"TEST_DIR": TESTS_DIR}, demux=False)
    output = (result.output or b"").decode("utf-8", errors="replace")
    if result.exit_code == TIMED_OUT:
        raise EvaluationError(f"tests timed out: they did not finish within {budget:g} s", output)
    try:
        tests = parser(output)
    except ValueError as exc:
        raise EvaluationError(f"test output could not be parsed: {exc}", output) from None
    return Evaluation(output=output, tests=tests, score=score(tests))
