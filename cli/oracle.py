"""`dataset oracle`: run each task's reference solution as one episode through the runs API.

Per task, one `Pool.episode` of termpool.client: the task, a script of two tool calls
(write solution.sh to /tmp/solution.sh, then `bash /tmp/solution.sh`, blocking), evaluate
and close, waited for step by step. A Harbor task's script is its oracle agent's: solution/
uploaded to /solution, solve.sh run with the [solution] env (harbor_script). The reward is the run's score. A task that ends without
one is an error with the failure code of its run (poolcore/failures.py), so a report tells
broken tasks (task codes) from infrastructure trouble worth another run (retryable codes).
A full service (429) is waited out by the client's retries with backoff.
"""

from __future__ import annotations

import base64
import math
import os
import posixpath
import shlex
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from poolcore.harbor_task import HarborTaskError, is_harbor_task, resolve_env
from poolcore.task_spec import TaskError, load_task
from termpool.client import (
    Episode,
    Forbidden,
    Pool,
    ServiceUnreachable,
    TermpoolError,
    Unauthorized,
    WaitTimeout,
    exec_call,
    write_file_call,
)

SOLUTION_FILE = "solution.sh"
SOLUTION_PATH = "/tmp/solution.sh"
MIN_SOLUTION_TIMEOUT = 600.0
CAPACITY_BACKOFF = 15.0  # longest pause between two tries of a full service
OUTCOMES = ("passed", "partial", "failed", "error", "skipped")


class ServiceError(RuntimeError):
    """The service cannot be used at all (unreachable, refuses the token)."""


@dataclass
class OracleResult:
    task: str
    task_path: str
    outcome: str  # one of OUTCOMES
    reward: float | None = None
    run_id: str = ""
    state: str = ""
    tests: dict = field(default_factory=dict)
    error: str = ""
    code: str = ""  # the failure code of an error outcome ("" when the service gave none)
    seconds: float = 0.0
    solution_output: str = ""
    jobs: list = field(default_factory=list)

    @property
    def tests_passed(self) -> str:
        if not self.tests:
            return ""
        passed = sum(1 for v in self.tests.values() if str(v).lower() in ("passed", "true", "1"))
        return f"{passed}/{len(self.tests)}"

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "task_path": self.task_path,
            "outcome": self.outcome,
            "reward": self.reward,
            "run_id": self.run_id,
            "state": self.state,
            "tests": self.tests,
            "error": self.error,
            "code": self.code,
            "seconds": round(self.seconds, 1),
            "solution_output": self.solution_output,
            "jobs": self.jobs,
        }


def outcome_of(reward) -> str:
    if reward >= 1.0 - 1e-9:
        return "passed"
    return "partial" if reward > 0 else "failed"


def summarize(results: list[OracleResult]) -> dict:
    counts = {name: sum(1 for r in results if r.outcome == name) for name in OUTCOMES}
    rewards = [r.reward for r in results if r.reward is not None]
    codes: dict[str, int] = {}
    for r in results:
        if r.outcome == "error":
            codes[r.code or "none"] = codes.get(r.code or "none", 0) + 1
    return {
        "tasks": len(results),
        "passed": counts["passed"],
        "partial": counts["partial"],
        "failed": counts["failed"],
        "errors": counts["error"],
        "skipped": counts["skipped"],
        "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "errors_by_code": dict(sorted(codes.items())),
    }


def connect(url: str, token: str = "", capacity_wait: float = 600.0) -> Pool:
    """A client that waits out a full service for about `capacity_wait` seconds."""
    return Pool(
        url,
        token=token or None,
        timeout=90.0,
        backoff=2.0,
        max_backoff=CAPACITY_BACKOFF,
        retries=max(1, math.ceil(capacity_wait / (0.75 * CAPACITY_BACKOFF))) + 3,
    )


def check(pool: Pool) -> None:
    """Fail early (ServiceError) when the service is unreachable or refuses us."""
    try:
        pool.status()
    except ServiceUnreachable as exc:
        raise ServiceError(f"cannot reach the termpool service at {pool.url}: {exc}") from None
    except (Unauthorized, Forbidden) as exc:
        raise ServiceError(f"{pool.url} refused us ({exc.status}): {exc}") from None


@dataclass
class OracleSettings:
    dataset_root: Path  # the service's DATASET_DIR: task_path is relative to it
    timeout: float | None = None  # whole episode; None: from the task and the service defaults
    solution_timeout: float | None = None
    default_budget: float = 1800.0
    env_allowlist: tuple = ()  # HARBOR_ENV_ALLOWLIST: host variables [solution] env may read


def task_path_for(task_dir: Path, dataset_root: Path, scan_root: Path) -> str:
    """task_meta.task_path: relative to the service's DATASET_DIR when the task is inside it."""
    for base in (dataset_root, scan_root):
        try:
            rel = task_dir.resolve().relative_to(Path(base).resolve()).as_posix()
            if rel and rel != ".":
                return rel
        except ValueError:
            continue
    return task_dir.name


def episode_args(task_dir: Path, task_path: str, instruction: str, solution: str, solution_timeout: float) -> dict:
    """Pool.episode's arguments: write the solution, run it (blocking), evaluate, close."""
    return {
        "task": task_dir.name,
        "task_path": task_path,
        "instruction": instruction,
        "request_id": uuid.uuid4().hex,
        "run_ctx": {"uid": f"oracle-{uuid.uuid4().hex[:8]}"},
        "script": [
            write_file_call(SOLUTION_PATH, solution),
            exec_call(f"bash {SOLUTION_PATH}", id="oracle", timeout=solution_timeout),
        ],
        "evaluate": True,
        "close": True,
    }


# ---- a Harbor task: as Harbor's oracle agent runs it ------------------------------------------
HARBOR_SOLUTION_DIR = "/solution"


UPLOAD_CHUNK = 1 << 16  # base64 characters per command: well under Linux's 128 KiB per argument


def _binary_upload(target: str, data: bytes) -> list[dict]:
    encoded = base64.b64encode(data).decode()
    calls = [exec_call(f"mkdir -p {shlex.quote(posixpath.dirname(target))} && : > {shlex.quote(target)}", id="upload")]
    for start in range(0, len(encoded), UPLOAD_CHUNK):
        chunk = encoded[start : start + UPLOAD_CHUNK]
        calls.append(exec_call(f"echo {chunk} | base64 -d >> {shlex.quote(target)}", id="upload", timeout=120))
    return calls


def harbor_script(task_dir: Path, env: dict, solution_timeout: float) -> list[dict]:
    """solution/ uploaded to /solution (binary files through base64), then solve.sh run with
    the [solution] env (already resolved) and DEBIAN_FRONTEND=noninteractive, from where the
    shell tool's sessions of a Harbor task start: where Harbor's exec starts."""
    calls = []
    for path in sorted(p for p in (task_dir / "solution").rglob("*") if p.is_file()):
        target = f"{HARBOR_SOLUTION_DIR}/{path.relative_to(task_dir / 'solution').as_posix()}"
        data = path.read_bytes()
        try:
            calls.append(write_file_call(target, data.decode("utf-8")))
        except UnicodeDecodeError:
            calls += _binary_upload(target, data)
    solve = f"{HARBOR_SOLUTION_DIR}/solve.sh"
    variables = " ".join(shlex.quote(f"{k}={v}") for k, v in {**env, "DEBIAN_FRONTEND": "noninteractive"}.items())
    command = f"chmod +x {solve} && env {variables} {solve}"
    return calls + [exec_call(command, id="oracle", timeout=solution_timeout)]


def run_oracle(pool: Pool, task_dir: Path, label: str, task_path: str, opts: OracleSettings) -> OracleResult:
    started = time.monotonic()
    result = OracleResult(task=label, task_path=task_path, outcome="error")
    try:
        _run(pool, task_dir, task_path, opts, result)
    except TermpoolError as exc:  # refused, after the client's retries
        result.outcome, result.error, result.code = "error", str(exc), exc.code
    except Exception as exc:  # one task's trouble is a row of the report
        result.outcome, result.error = "error", f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - started
    return result


def _run(pool: Pool, task_dir: Path, task_path: str, opts: OracleSettings, result: OracleResult) -> None:
    harbor = is_harbor_task(task_dir) and not (task_dir / "task.yaml").is_file()
    solution_file = task_dir / ("solution/solve.sh" if harbor else SOLUTION_FILE)
    if not solution_file.is_file():
        result.outcome, result.error = "skipped", f"no {solution_file.relative_to(task_dir)}"
        return
    try:
        spec = load_task(task_dir)
        env = resolve_env(spec.harbor.solution_env, os.environ, opts.env_allowlist) if harbor else {}
    except (TaskError, HarborTaskError) as exc:
        result.error, result.code = f"task does not load: {exc}", "TASK_INVALID"
        return
    solution_timeout = opts.solution_timeout or max(MIN_SOLUTION_TIMEOUT, spec.max_agent_timeout_sec)
    budget = opts.timeout or opts.default_budget + solution_timeout
    solution = "" if harbor else solution_file.read_text(encoding="utf-8")
    args = episode_args(task_dir, task_path, spec.instruction, solution, solution_timeout)
    if harbor:
        args["script"] = harbor_script(task_dir, env, solution_timeout)
    try:
        episode = pool.episode(**args, check=False, timeout=budget)
    except WaitTimeout as exc:  # the client closed the run
        result.run_id, result.code = getattr(exc, "run_id", ""), exc.code
        result.error = f"the episode did not end within {budget:g} s: {exc}"
        return
    _fill(result, episode)


def _fill(result: OracleResult, episode: Episode) -> None:
    run = episode.run
    result.run_id, result.state, result.tests = episode.run_id, episode.state, episode.tests
    result.jobs = [
        {k: job.get(k) for k in ("job_id", "kind", "state", "error", "code", "attempts")} for job in episode.jobs
    ]
    outputs = [text for text in episode.observations if isinstance(text, str)]
    if outputs:
        result.solution_output = outputs[-1][-2000:]
    if episode.score is not None:
        result.reward = episode.score
        result.outcome = outcome_of(result.reward)
        return
    failure = episode.failure
    result.outcome = "error"
    result.error = (
        run.get("error")
        or (failure.job.get("error") if failure else "")
        or f"the run ended ({result.state}) without a score"
    )
    result.code = run.get("code") or (failure.code if failure else "") or ""
