"""`dataset oracle`: run each task's reference solution as one episode through the runs API.

Per task: POST /v1/runs with the task, a script of two tool calls (write solution.sh to
/tmp/solution.sh, then `bash /tmp/solution.sh`, blocking), evaluate and close; then follow
the run's jobs with long polls (GET /v1/jobs/<id>?wait=30) and the run record (GET
/v1/runs/<id>) until the run is closed (or failed with no job left to wait for, in which
case the oracle closes it). The reward is the run's score. A task that ends without one
is an error with the failure code of its run (termpool/failures.py), so a report tells
broken tasks (task codes) from infrastructure trouble worth another run (retryable codes).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import requests

from termpool.task_spec import TaskError, load_task

SOLUTION_FILE = "solution.sh"
SOLUTION_PATH = "/tmp/solution.sh"
MIN_SOLUTION_TIMEOUT = 600.0
JOB_WAIT = 30  # seconds per long poll (the API allows up to 60)
ENDED_JOB_STATES = ("succeeded", "failed")
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
        return {"task": self.task, "task_path": self.task_path, "outcome": self.outcome, "reward": self.reward,
                "run_id": self.run_id, "state": self.state, "tests": self.tests, "error": self.error, "code": self.code,
                "seconds": round(self.seconds, 1), "solution_output": self.solution_output, "jobs": self.jobs}


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
    return {"tasks": len(results), "passed": counts["passed"], "partial": counts["partial"],
            "failed": counts["failed"], "errors": counts["error"], "skipped": counts["skipped"],
            "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
            "errors_by_code": dict(sorted(codes.items()))}


class RunsClient:
    """The few runs API calls the oracle needs, with the bearer token when one is set."""

    def __init__(self, url: str, token: str = "", timeout: float = 90.0):
        self.url = url.rstrip("/")
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout

    def _call(self, method: str, path: str, **kw) -> requests.Response:
        return self.session.request(method, self.url + path, timeout=kw.pop("timeout", self.timeout), **kw)

    def check(self) -> None:
        try:
            reply = self._call("GET", "/healthz", timeout=10)
            status = self._call("GET", "/status", timeout=30)
        except requests.RequestException as exc:
            raise ServiceError(f"cannot reach the termpool service at {self.url}: {exc}") from None
        if not reply.ok:
            raise ServiceError(f"{self.url}/healthz answered {reply.status_code}")
        if status.status_code in (401, 403):
            raise ServiceError(f"{self.url} refused us ({status.status_code}): {_error_text(status)}")

    def create_run(self, body: dict) -> requests.Response:
        return self._call("POST", "/v1/runs", json=body)

    def run(self, run_id: str) -> dict:
        reply = self._call("GET", f"/v1/runs/{run_id}")
        _expect(reply, 200)
        return reply.json()["run"]

    def job(self, job_id: str, wait: float) -> dict | None:
        reply = self._call("GET", f"/v1/jobs/{job_id}", params={"wait": int(wait)}, timeout=wait + 60)
        if reply.status_code == 404:
            return None
        _expect(reply, 200)
        return reply.json()["job"]

    def close(self, run_id: str) -> None:
        try:
            self._call("DELETE", f"/v1/runs/{run_id}")
        except requests.RequestException:
            pass


def _error_text(reply: requests.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:300]
    return str(body.get("error") or body) if isinstance(body, dict) else str(body)[:300]


def _error_code(reply: requests.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return ""
    return str(body.get("code") or "") if isinstance(body, dict) else ""


def _expect(reply: requests.Response, status: int) -> None:
    if reply.status_code != status:
        raise RuntimeError(f"{reply.request.method} {reply.url} answered {reply.status_code}: {_error_text(reply)}")


@dataclass
class OracleSettings:
    dataset_root: Path  # the service's DATASET_DIR: task_path is relative to it
    timeout: float | None = None  # whole episode; None: from the task and the service defaults
    solution_timeout: float | None = None
    capacity_wait: float = 600.0  # how long to retry a 429
    default_budget: float = 1800.0


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


def episode_body(task_dir: Path, task_path: str, instruction: str, solution: str, solution_timeout: float) -> dict:
    name = task_dir.name
    return {
        "task_key": name,
        "request_id": uuid.uuid4().hex,
        "task_meta": {"task_name": name, "task_path": task_path, "instruction": instruction},
        "run_ctx": {"uid": f"oracle-{uuid.uuid4().hex[:8]}"},
        "script": [
            {"name": "shell_write_content_to_file", "arguments": {"content": solution, "file_path": SOLUTION_PATH}},
            {"name": "shell_exec", "arguments": {"id": "oracle", "command": f"bash {SOLUTION_PATH}", "block": True,
                                                 "timeout": solution_timeout}},
        ],
        "evaluate": True,
        "close": True,
    }


def run_oracle(client: RunsClient, task_dir: Path, label: str, task_path: str, opts: OracleSettings) -> OracleResult:
    started = time.monotonic()
    result = OracleResult(task=label, task_path=task_path, outcome="error")
    try:
        _run(client, task_dir, task_path, opts, result)
    except Exception as exc:  # one task's trouble is a row of the report
        result.outcome, result.error = "error", result.error or f"{type(exc).__name__}: {exc}"
        if result.run_id:
            client.close(result.run_id)
    result.seconds = time.monotonic() - started
    return result


def _run(client: RunsClient, task_dir: Path, task_path: str, opts: OracleSettings, result: OracleResult) -> None:
    solution_file = task_dir / SOLUTION_FILE
    if not solution_file.is_file():
        result.outcome, result.error = "skipped", f"no {SOLUTION_FILE}"
        return
    try:
        spec = load_task(task_dir)
        instruction, agent_timeout = spec.instruction, spec.max_agent_timeout_sec
    except TaskError as exc:
        result.error = f"task does not load: {exc}"
        return
    solution_timeout = opts.solution_timeout or max(MIN_SOLUTION_TIMEOUT, agent_timeout)
    budget = opts.timeout or opts.default_budget + solution_timeout
    deadline = time.monotonic() + budget

    body = episode_body(task_dir, task_path, instruction, solution_file.read_text(encoding="utf-8"),
                        solution_timeout)
    run_id = _submit(client, body, time.monotonic() + opts.capacity_wait, result)
    if not run_id:
        return
    result.run_id = run_id

    jobs: dict[str, dict] = {}  # ended jobs by id
    run = client.run(run_id)
    while run.get("state") != "closed":
        pending = [j for j in run.get("jobs") or [] if j not in jobs]
        if run.get("state") == "failed" and not pending:
            client.close(run_id)  # failed and nothing left to do: make sure the slot is freed
            break
        if time.monotonic() > deadline:
            result.error = f"the episode did not end within {budget:g} s (run state {run.get('state')})"
            result.state = run.get("state", "")
            client.close(run_id)
            return
        if pending:  # follow the episode's current step (jobs are listed in chain order)
            job = client.job(pending[0], min(JOB_WAIT, max(1.0, deadline - time.monotonic())))
            if job is None or job.get("state") in ENDED_JOB_STATES:
                jobs[pending[0]] = job or {"job_id": pending[0], "state": "unknown"}
        else:
            time.sleep(1.0)
        run = client.run(run_id)

    for job_id in run.get("jobs") or []:  # records not followed yet (ended between polls)
        if job_id not in jobs:
            jobs[job_id] = client.job(job_id, 0) or {"job_id": job_id, "state": "unknown"}
    _fill(result, run, [jobs[j] for j in run.get("jobs") or []])


def _submit(client: RunsClient, body: dict, capacity_deadline: float, result: OracleResult) -> str:
    """POST /v1/runs; a 429 is retried (same request id) until capacity_deadline."""
    delay = 2.0
    while True:
        reply = client.create_run(body)
        if reply.status_code in (200, 201, 202):
            return reply.json()["run_id"]
        if reply.status_code == 429 and time.monotonic() + delay < capacity_deadline:
            time.sleep(delay)
            delay = min(delay * 1.5, 15.0)
            continue
        result.error = f"POST /v1/runs answered {reply.status_code}: {_error_text(reply)}"
        result.code = _error_code(reply)
        return ""


def _fill(result: OracleResult, run: dict, jobs: list[dict]) -> None:
    result.state = run.get("state", "")
    result.tests = run.get("tests") or {}
    result.jobs = [{k: job.get(k) for k in ("job_id", "kind", "state", "error", "code", "attempts")} for job in jobs]
    tool_jobs = [job for job in jobs if isinstance(job.get("result"), str)]
    if tool_jobs:
        result.solution_output = tool_jobs[-1]["result"][-2000:]
    score = run.get("score")
    if isinstance(score, (int, float)) and not isinstance(score, bool):
        result.reward = float(score)
        result.outcome = outcome_of(result.reward)
        return
    failed = [job for job in jobs if job.get("state") == "failed" and job.get("error")]
    result.outcome = "error"
    result.error = run.get("error") or (failed[0]["error"] if failed else "") or \
        f"the run ended ({result.state}) without a score"
    result.code = run.get("code") or (failed[0].get("code") if failed else "") or ""
