"""Verify a Harbor task as Harbor's verifier does, in the run's agent's (`main`) container.

At evaluation only: tests/ is copied to /tests, test.sh runs as
`(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1` with the task's verifier env, as the
container's user (or verifier.user), in its working directory, within verifier.timeout_sec;
its exit code means nothing. The reward is /logs/verifier/reward.json when present, else
reward.txt; neither (or an empty one) is REWARD_MISSING, never a 0. /logs/verifier is the
run's sessions/ folder (environments/harbor_compose.py), so both files stay with its artifacts.
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
from pathlib import Path

from environments import kept_result
from environments.evaluation import TIMED_OUT, Evaluation
from environments.harbor_compose import VERIFIER_DIR
from environments.session_helper import HELPER_PATH
from poolcore.failures import DockerError, RewardMissing, TaskInvalid, TestsTimeout, TestsUnparsable
from poolcore.harbor_task import HarborTaskError, resolve_env
from poolcore.task_spec import TaskSpec

TESTS_DIR = "/tests"
STDOUT_NAME = "test-stdout.txt"
REWARD_JSON = "reward.json"
REWARD_TXT = "reward.txt"
MAX_REWARD_BYTES = 1 << 20  # a reward file is a number or a small object
MAX_OUTPUT_BYTES = 4 << 20  # of test-stdout.txt kept in the run's tests.log


def tests_archive(task_dir: Path) -> bytes:
    """tests/ laid out as /tests (its contents, as Harbor uploads the folder)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(task_dir / "tests", arcname="tests")
    return buf.getvalue()


def copy_tests(container, task_dir: Path) -> None:
    """Put tests/ at /tests and get /logs/verifier ready: made writable for any verifier user
    (as Harbor does at start) and without a reward file left from before this evaluation (an
    agent's, or a former evaluation's: termpool may evaluate a run more than once)."""
    if not container.put_archive("/", tests_archive(task_dir)):
        raise DockerError("could not copy the tests into the container")
    prepare = (
        f"mkdir -p {VERIFIER_DIR} && chmod 777 {VERIFIER_DIR} && "
        f"rm -f {VERIFIER_DIR}/{REWARD_JSON} {VERIFIER_DIR}/{REWARD_TXT} && chmod +x {TESTS_DIR}/test.sh"
    )
    result = container.exec_run(["sh", "-c", prepare], user="root")
    if result.exit_code != 0:
        raise DockerError(f"could not prepare {VERIFIER_DIR}: {(result.output or b'').decode(errors='replace')}")


def run_tests(container, spec: TaskSpec, eval_timeout: float, verifier_dir: Path, allowed=()) -> Evaluation:
    """Run test.sh within its budget and read the reward the verifier left in `verifier_dir`
    (the host side of /logs/verifier). TestsTimeout / RewardMissing / TestsUnparsable carry
    the test output, for the run's artifacts. `allowed`: the host variables the verifier env's
    templates may read (HARBOR_ENV_ALLOWLIST)."""
    budget = spec.test_time_limit(eval_timeout)
    try:
        env = resolve_env(spec.harbor.verifier_env, os.environ, allowed)
    except HarborTaskError as exc:
        raise TaskInvalid(f"[verifier] {exc}") from None
    # `; exit 0`: test.sh's status is ignored, and only run-timeout's own 124 means a timeout.
    command = f"({TESTS_DIR}/test.sh) > {VERIFIER_DIR}/{STDOUT_NAME} 2>&1; exit 0"
    result = kept_result.run(
        container,
        [HELPER_PATH, "run-timeout", f"{budget:g}", "--", "bash", "-c", command],
        user=spec.harbor.verifier_user,  # "" is the container's own user
        environment=env,
        limit=budget + kept_result.SLACK_SECONDS,
    )
    output = _read(verifier_dir / STDOUT_NAME, MAX_OUTPUT_BYTES) or ""
    if result.exit_code == TIMED_OUT:
        raise TestsTimeout(f"tests timed out: they did not finish within {budget:g} s", output)
    if result.exit_code != 0:  # the helper itself failed (test.sh's status never reaches here)
        raise DockerError(f"the verifier could not run: {(result.output or b'').decode(errors='replace')[-2000:]}")
    rewards = read_rewards(verifier_dir, output)
    return Evaluation(output=output, tests={}, score=score(rewards), rewards=rewards)


def _read(path: Path, limit: int) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _number(text: str, where: str, output: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise TestsUnparsable(f"{where} is not a number: {text.strip()[:200]!r}", output) from None
    if not math.isfinite(value):
        raise TestsUnparsable(f"{where} is not a finite number: {text.strip()[:200]!r}", output)
    return value


def read_rewards(verifier_dir: Path, output: str = "") -> dict[str, float]:
    """Harbor's reading of the verifier's files: reward.json (an object; its numeric values
    are the rewards, other values ignored; no `reward` key and a reward.txt: that file gives
    `reward`), else reward.txt (one number, as `reward`). Missing or empty: RewardMissing."""
    text = _read(verifier_dir / REWARD_JSON, MAX_REWARD_BYTES)
    if text is not None:
        if not text.strip():
            raise RewardMissing(f"{VERIFIER_DIR}/{REWARD_JSON} is empty", output)
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise TestsUnparsable(f"{VERIFIER_DIR}/{REWARD_JSON} is not JSON: {exc}", output) from None
        if not isinstance(parsed, dict):
            raise TestsUnparsable(f"{VERIFIER_DIR}/{REWARD_JSON} must be a JSON object", output)
        rewards = {
            key: float(value)
            for key, value in parsed.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        fallback = _read(verifier_dir / REWARD_TXT, MAX_REWARD_BYTES)
        if "reward" not in rewards and fallback and fallback.strip():
            rewards["reward"] = _number(fallback, f"{VERIFIER_DIR}/{REWARD_TXT}", output)
        if not rewards:
            raise RewardMissing(f"{VERIFIER_DIR}/{REWARD_JSON} holds no numeric reward", output)
        return rewards
    text = _read(verifier_dir / REWARD_TXT, MAX_REWARD_BYTES)
    if text is None:
        raise RewardMissing(f"the verifier wrote no {VERIFIER_DIR}/{REWARD_TXT} or {REWARD_JSON}", output)
    if not text.strip():
        raise RewardMissing(f"{VERIFIER_DIR}/{REWARD_TXT} is empty", output)
    return {"reward": _number(text, f"{VERIFIER_DIR}/{REWARD_TXT}", output)}


def score(rewards: dict[str, float]) -> float:
    """The one score termpool answers: `reward` when present, else the mean of the named
    rewards (Harbor keeps them all and has no single score then; all stay in `rewards`)."""
    if "reward" in rewards:
        return rewards["reward"]
    return sum(rewards.values()) / len(rewards)
