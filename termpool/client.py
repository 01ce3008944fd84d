"""A Python client for termpool: `Pool` (blocking) and `AsyncPool` (asyncio), with typed errors.

    from termpool.client import Pool

    with Pool("http://127.0.0.1:18081") as pool:
        with pool.start("hello-world") as run:        # closed on exit, whatever happens
            print(run.exec("ls -la /app"))
            run.write_file("/app/hello.txt", "Hello, world!\\n")
            print(run.evaluate().score)               # 1.0

Which face: runs (Pool.start, Pool.episode) go through the runs API (/v1). Each operation
is submitted (202 with a job id) and then waited for with long polls
(GET /v1/jobs/<id>?wait=S, S <= 60), so no HTTP request is held longer than a minute
however long the job runs (proxies and load balancers cut long requests), a dropped
connection loses a poll and not the operation, and a failed job's record carries its
`code` and `retryable`. The blocking pool API, which existing routers need byte for byte, is
there too (Pool.allocate: a Lease whose calls block until their job is done), for the
benchmark, the chaos suite and the tests that drive it; `Pool.status()` and
`Pool.healthy()` read the two endpoints both faces share, and `Pool.request()` sends one
request as is, for callers that look at the HTTP reply itself.

Retries: a failure whose reply says `retryable: true` is sent again, with exponential
backoff and jitter, when that cannot do the work twice: always for reads, DELETE and
POST /v1/runs (idempotent: the client always sends a request_id), and for any request the
service refused before doing anything (429 capacity, or a connection that was never made).
A tool call, reset or evaluation that failed after it was accepted is never resent; a
failed job raises its typed error for the caller to decide (an infrastructure error means: run the
episode again).

This module needs only httpx and termpool/codes.py (pure data): nothing of the server's.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import httpx

from termpool.codes import CODES, HTTP_STATUS_CODES

__all__ = [
    "Pool",
    "AsyncPool",
    "Run",
    "AsyncRun",
    "Lease",
    "AsyncLease",
    "Job",
    "AsyncJob",
    "Evaluation",
    "Episode",
    "tool_call",
    "exec_call",
    "write_file_call",
    "task_meta",
    "TermpoolError",
    "ClientError",
    "TaskError",
    "InfrastructureError",
    "CapacityExhausted",
    "ServiceUnreachable",
    "WaitTimeout",
    "error_class",
]

DEFAULT_URL = "http://127.0.0.1:18081"
MAX_LONG_POLL = 60.0  # the runs API's upper bound for ?wait=
JOB_ENDED = ("succeeded", "failed")


# ---- errors ---------------------------------------------------------------------------------
class TermpoolError(Exception):
    """A failed request or job. `code` is one of termpool/codes.py's (or a client-side one:
    UNREACHABLE, WAIT_TIMEOUT); `retryable` says whether running it again can help; `status`
    is the HTTP status (None for a failed job, whose reply was a 200, and for a connection
    that failed); `job` is the failed job's record, when a job failed."""

    code = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retryable: bool | None = None,
        status: int | None = None,
        job: dict | None = None,
        reply: dict | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code or type(self).code
        known = CODES.get(self.code)
        self.retryable = retryable if isinstance(retryable, bool) else bool(known and known.retryable)
        self.kind = known.kind if known else None
        self.status = status
        self.job = job
        self.reply = reply

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code!r}, retryable={self.retryable}, status={self.status}, "
            f"message={self.message[:200]!r})"
        )


class ClientError(TermpoolError):
    """The request is wrong; sent again unchanged it gets the same answer (but see capacity)."""


class TaskError(TermpoolError):
    """The task itself is broken (its image, services or tests): count the episode, do not rerun it."""


class InfrastructureError(TermpoolError):
    """termpool or its backends failed: the episode says nothing about the policy, run it again."""


class CapacityExhausted(ClientError):
    """The worker host is full (429); retryable once a run closes."""


# One class per code of termpool/codes.py; tests/test_client.py checks that none is missing.
class BadRequest(ClientError):
    code = "BAD_REQUEST"  # noqa: E701


class Unauthorized(ClientError):
    code = "UNAUTHORIZED"  # noqa: E701


class Forbidden(ClientError):
    code = "FORBIDDEN"  # noqa: E701


class NotFound(ClientError):
    code = "NOT_FOUND"  # noqa: E701


class MethodNotAllowed(ClientError):
    code = "METHOD_NOT_ALLOWED"  # noqa: E701


class PayloadTooLarge(ClientError):
    code = "PAYLOAD_TOO_LARGE"  # noqa: E701


class UnknownLease(ClientError):
    code = "UNKNOWN_LEASE"  # noqa: E701


class UnknownRun(ClientError):
    code = "UNKNOWN_RUN"  # noqa: E701


class UnknownJob(ClientError):
    code = "UNKNOWN_JOB"  # noqa: E701


class RunNotReady(ClientError):
    code = "RUN_NOT_READY"  # noqa: E701


class RunClosed(ClientError):
    code = "RUN_CLOSED"  # noqa: E701


class TaskSlotsExhausted(CapacityExhausted):
    code = "TASK_SLOTS_EXHAUSTED"  # noqa: E701


class RunSlotsExhausted(CapacityExhausted):
    code = "RUN_SLOTS_EXHAUSTED"  # noqa: E701


class TaskInvalid(TaskError):
    code = "TASK_INVALID"  # noqa: E701


class TaskBuildFailed(TaskError):
    code = "TASK_BUILD_FAILED"  # noqa: E701


class TaskStartFailed(TaskError):
    code = "TASK_START_FAILED"  # noqa: E701


class TaskUnsupported(TaskError):
    code = "TASK_UNSUPPORTED"  # noqa: E701


class TestsTimeout(TaskError):
    code = "TESTS_TIMEOUT"  # noqa: E701


class TestsUnparsable(TaskError):
    code = "TESTS_UNPARSABLE"  # noqa: E701


class BackendUnavailable(InfrastructureError):
    code = "BACKEND_UNAVAILABLE"  # noqa: E701


class DockerError(InfrastructureError):
    code = "DOCKER_ERROR"  # noqa: E701


class WorkerLost(InfrastructureError):
    code = "WORKER_LOST"  # noqa: E701


class OperationTimeout(InfrastructureError):
    code = "TIMEOUT"  # noqa: E701


class HostLost(InfrastructureError):
    code = "HOST_LOST"  # noqa: E701


class WorkersDown(InfrastructureError):
    code = "WORKERS_DOWN"  # noqa: E701


class InternalError(InfrastructureError):
    code = "INTERNAL"  # noqa: E701


class ServiceUnreachable(InfrastructureError):
    """No HTTP reply at all (connection refused, reset, timed out). Client-side code."""

    code = "UNREACHABLE"

    def __init__(self, message: str, **kw):
        super().__init__(message, retryable=True, **kw)


class WaitTimeout(TermpoolError, TimeoutError):
    """The client stopped waiting for a job (job_timeout); the job itself may still end."""

    code = "WAIT_TIMEOUT"


TestsTimeout.__test__ = TestsUnparsable.__test__ = False  # names pytest would otherwise collect

_KIND_BASES = {"client": ClientError, "task": TaskError, "infrastructure": InfrastructureError}
# A reply without a code (none expected, but a proxy may answer): the code its status means.
_STATUS_CODES = {
    **HTTP_STATUS_CODES,
    429: "RUN_SLOTS_EXHAUSTED",
    502: "BACKEND_UNAVAILABLE",
    503: "BACKEND_UNAVAILABLE",
    504: "TIMEOUT",
}


def _subclasses(cls: type) -> list[type]:
    return [cls] + [sub for child in cls.__subclasses__() for sub in _subclasses(child)]


_BY_CODE = {cls.code: cls for cls in _subclasses(TermpoolError)[1:] if "code" in cls.__dict__}


def error_class(code: str) -> type[TermpoolError]:
    """The exception class of a code: its own, else its kind's (a code newer than this client)."""
    if code in _BY_CODE:
        return _BY_CODE[code]
    known = CODES.get(code)
    return _KIND_BASES.get(known.kind, TermpoolError) if known else TermpoolError


def _reply_error(status: int, body: Any) -> TermpoolError:
    body = body if isinstance(body, dict) else {}
    code = body.get("code") or _STATUS_CODES.get(status, "INTERNAL")
    message = str(body.get("error") or f"HTTP {status}")
    return error_class(code)(message, code=code, retryable=body.get("retryable"), status=status, reply=body)


def _job_error(job: dict) -> TermpoolError:
    code = job.get("code") or "INTERNAL"
    message = f"{job.get('kind') or 'job'} job {job.get('job_id')} failed: {job.get('error') or 'no reason given'}"
    return error_class(code)(message, code=code, retryable=job.get("retryable"), job=job)


# ---- tool calls -----------------------------------------------------------------------------
def tool_call(name: str, **arguments) -> dict:
    """One tool call as the API takes it, e.g. in an episode's script."""
    return {"name": name, "arguments": arguments}


def exec_call(command: str, *, id: str = "main", block: bool | None = True, timeout: float | None = 20.0) -> dict:
    """shell_exec: `bash -c command` in /workspace; non-blocking (block=False) starts session `id`."""
    return tool_call("shell_exec", id=id, command=command, block=block, timeout=timeout)


def write_file_call(path: str, content: str) -> dict:
    """shell_write_content_to_file: `content` as UTF-8, unchanged, to `path`."""
    return tool_call("shell_write_content_to_file", content=content, file_path=path)


def task_meta(task: str, task_path: str | None = None, instruction: str | None = None) -> dict:
    """The task_meta of a start (POST /v1/runs, POST /reset): the task folder's name, its
    path under the service's DATASET_DIR (default: the name) and the instruction."""
    return {"task_name": task, "task_path": task_path or task, "instruction": instruction or ""}


# ---- results --------------------------------------------------------------------------------
@dataclass
class Evaluation:
    score: float  # the fraction of the task's tests that passed
    tests: dict  # test name -> "passed" / "failed"


@dataclass
class Episode:
    """The outcome of a one-shot episode (Pool.episode)."""

    run_id: str
    state: str
    score: float | None
    tests: dict
    observations: list  # the script's tool call results, in order (None for a step that failed)
    jobs: list  # every step's job record, in order
    run: dict  # the final run record
    failure: TermpoolError | None = None  # the first failed step's error


# ---- the protocol, written once for both drivers ---------------------------------------------
@dataclass(frozen=True)
class _Call:
    """One HTTP request. `idempotent`: sending it twice does the work once."""

    method: str
    path: str
    body: dict | None = None
    params: dict | None = None
    idempotent: bool = False
    long_poll: float | None = 0.0  # seconds the server may hold the reply (None: no limit)


# An operation is a generator that yields what to do (an HTTP request: a _Call; a pause: a
# number of seconds) and is sent the outcome (an httpx.Response, or has the transport error
# thrown in); it returns its result. Pool drives operations with blocking I/O, AsyncPool with
# awaited I/O, so the protocol, retries included, is written once.
Op = Generator[Any, Any, Any]


def _request(pool: _PoolOps, call: _Call) -> Op:
    """One request, sent again after retryable failures (pool._retry_delay); its JSON reply."""
    attempt = 0
    while True:
        try:
            outcome = pool._outcome(call, (yield call))
        except httpx.TransportError as exc:
            outcome = pool._unreachable(call, exc)
        if not isinstance(outcome, TermpoolError):
            return outcome
        delay = pool._retry_delay(call, outcome, attempt)
        if delay is None:
            raise outcome
        yield delay
        attempt += 1


def _wait_job(pool: _PoolOps, job_id: str, timeout: float | None, raise_failed: bool = True) -> Op:
    """Long-poll a job until it ends; its record. A failed job raises its typed error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = MAX_LONG_POLL if deadline is None else deadline - time.monotonic()
        wait = round(max(0.0, min(MAX_LONG_POLL, left)), 1)
        reply = yield from _request(
            pool, _Call("GET", f"/v1/jobs/{job_id}", params={"wait": wait}, idempotent=True, long_poll=wait)
        )
        job = reply["job"]
        if job.get("state") == "failed" and raise_failed:
            raise _job_error(job)
        if job.get("state") in JOB_ENDED:
            return job
        if left <= 0:
            raise WaitTimeout(f"job {job_id} ({job.get('kind')}) is still {job.get('state')} after {timeout:g} s")


def _run_body(
    task: str,
    task_path: str | None,
    instruction: str | None,
    request_id: str | None,
    run_ctx: dict | None,
    task_timeouts: dict | None,
    task_key: str | None,
) -> dict:
    body = {
        "task_key": task_key or task,
        "task_meta": task_meta(task, task_path, instruction),
        "request_id": request_id or uuid.uuid4().hex,
    }
    return {**body, **_options(run_ctx, task_timeouts)}


def _options(run_ctx: dict | None, task_timeouts: dict | None) -> dict:
    """A start's optional fields, when given (both faces take them the same way)."""
    return {k: v for k, v in (("run_ctx", run_ctx), ("task_timeouts", task_timeouts)) if v}


def _episode(run_id: str, run: dict, jobs: list[dict]) -> Episode:
    failed = [job for job in jobs if job.get("state") == "failed"]
    tool_jobs = [job for job in jobs if job.get("kind") == "tool_call"]
    score = run.get("score")
    return Episode(
        run_id=run_id,
        state=run.get("state", ""),
        run=run,
        jobs=jobs,
        tests=run.get("tests") or {},
        score=float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else None,
        observations=[job.get("result") if job.get("state") == "succeeded" else None for job in tool_jobs],
        failure=_job_error(failed[0]) if failed else None,
    )


class _Ops:
    """Base of the objects whose methods are operations; `_pool` drives them."""

    _pool: _PoolOps

    def _call(self, method: str, path: str, **options) -> Op:
        return (yield from _request(self._pool, _Call(method, path, **options)))


def _blocking(op):
    """A method that drives the operation `op` to its end with blocking requests."""

    @functools.wraps(op)
    def method(self, *args, **kwargs):
        return self._pool._drive(op(self, *args, **kwargs))

    return method


def _awaitable(op):
    """A coroutine method that drives the operation `op` with awaited requests."""

    @functools.wraps(op)
    async def method(self, *args, **kwargs):
        return await self._pool._drive(op(self, *args, **kwargs))

    return method


class _JobOps(_Ops):
    def __init__(self, pool, job_id: str):
        self._pool = pool
        self.id = job_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def wait(self, timeout: float | None = None) -> Op:
        """The job's result once it has succeeded (observation text, {score, tests}, ...);
        raises its typed error when it failed, WaitTimeout after `timeout` (default: the
        pool's job_timeout)."""
        job = yield from _wait_job(self._pool, self.id, self._pool.job_timeout if timeout is None else timeout)
        return job.get("result")

    def record(self) -> Op:
        """The job's record as it is now: state, result, error, code, retryable, times."""
        return (yield from self._call("GET", f"/v1/jobs/{self.id}", idempotent=True))["job"]


class _SessionOps(_Ops):
    """The tools of one task environment, whichever face carries them (`_tool`)."""

    id: str

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def _tool(self, call: dict) -> Op:
        """Run one tool call (tool_call's dict); its observation text."""
        raise NotImplementedError

    def tool(self, name: str, **arguments) -> Op:
        """Run any tool call and return its observation text."""
        return (yield from self._tool(tool_call(name, **arguments)))

    def exec(self, command: str, *, id: str = "main", block: bool | None = True, timeout: float | None = 20.0) -> Op:
        """shell_exec: the command's output (blocking), or the session-started text (block=False)."""
        return (yield from self._tool(exec_call(command, id=id, block=block, timeout=timeout)))

    def view(self, id: str = "main") -> Op:
        """shell_view: the output of session `id` since the last view."""
        return (yield from self._tool(tool_call("shell_view", id=id)))

    def write_to_process(self, id: str, text: str) -> Op:
        """shell_write_to_process: send `text` and a newline to session `id`; what it printed."""
        return (yield from self._tool(tool_call("shell_write_to_process", id=id, command=text)))

    def write_file(self, path: str, content: str) -> Op:
        """shell_write_content_to_file: write `content` to `path` in the task container."""
        return (yield from self._tool(write_file_call(path, content)))


class _RunOps(_SessionOps):
    def __init__(self, pool, run_id: str, start_job: str | None = None, start: dict | None = None):
        self._pool = pool
        self.id = run_id
        self.start_job = start_job
        start = start or {}
        self.user_msg: str | None = start.get("user_msg")  # the task's prompt, once started
        self.tool_schemas: list | None = start.get("tool_schemas")  # the four tools' schemas

    def _submit(self, call: dict) -> Op:
        reply = yield from self._call("POST", f"/v1/runs/{self.id}/tool_calls", body=call)
        return self._pool._job_class(self._pool, reply["job_id"])

    def submit(self, name: str, **arguments) -> Op:
        """Submit any tool call without waiting: its Job (call .wait() for the observation)."""
        return (yield from self._submit(tool_call(name, **arguments)))

    def _tool(self, call: dict) -> Op:
        job = yield from self._submit(call)
        return (yield from _wait_job(self._pool, job.id, self._pool.job_timeout))["result"]

    def evaluate(self) -> Op:
        """Run the task's tests: an Evaluation (score, per-test results)."""
        reply = yield from self._call("POST", f"/v1/runs/{self.id}/evaluation")
        result = (yield from _wait_job(self._pool, reply["job_id"], self._pool.job_timeout))["result"] or {}
        return Evaluation(score=float(result.get("score") or 0.0), tests=result.get("tests") or {})

    def wait_ready(self) -> Op:
        """Wait for the start job (after Pool.start(wait=False)); raises its error if it failed."""
        result = (yield from _wait_job(self._pool, self.start_job, self._pool.job_timeout))["result"] or {}
        self.user_msg, self.tool_schemas = result.get("user_msg"), result.get("tool_schemas")
        return self

    def info(self) -> Op:
        """The run record: state, host, score, tests, error, code, job ids, ..."""
        return (yield from self._call("GET", f"/v1/runs/{self.id}", idempotent=True))["run"]

    def close(self, wait: bool = False) -> Op:
        """Release the run (its capacity slot frees at once) and queue its teardown; with
        wait=True, return only once its containers are gone. Closing twice is harmless."""
        reply = yield from self._call("DELETE", f"/v1/runs/{self.id}", idempotent=True)
        if wait and reply.get("job_id"):
            yield from _wait_job(self._pool, reply["job_id"], self._pool.job_timeout, raise_failed=False)


class _LeaseOps(_SessionOps):
    """One lease of the blocking pool API: each call is one request that returns when its job
    is done (so its reply may take up to the pool's job_timeout, a reset with a build)."""

    def __init__(self, pool, lease_id: str, reused: bool = False):
        self._pool = pool
        self.id = lease_id
        self.reused = reused  # /allocate gave back the lease of the same request_id
        self.user_msg: str | None = None  # the task's prompt, once reset
        self.tool_schemas: list | None = None

    def _post(self, path: str, fields: dict | None = None, idempotent: bool = False) -> Op:
        body = {"lease_id": self.id, **(fields or {})}
        return (yield from self._call("POST", path, body=body, idempotent=idempotent, long_poll=self._pool.job_timeout))

    def reset(
        self,
        task: str,
        *,
        task_path: str | None = None,
        instruction: str | None = None,
        run_ctx: dict | None = None,
        task_timeouts: dict | None = None,
    ) -> Op:
        """(Re)start the lease's environment for `task` (POST /reset; a second reset replaces
        the first environment); the lease, with user_msg and tool_schemas set."""
        fields = {"task_meta": task_meta(task, task_path, instruction), **_options(run_ctx, task_timeouts)}
        reply = yield from self._post("/reset", fields)
        self.user_msg, self.tool_schemas = reply.get("user_msg"), reply.get("tool_schemas")
        return self

    def _tool(self, call: dict) -> Op:
        return (yield from self._post("/exec_tool", {"tool_call": call}))["observation"]

    def evaluate(self) -> Op:
        """Run the task's tests (POST /evaluate): an Evaluation (tests: {} when the reply has none)."""
        reply = yield from self._post("/evaluate")
        return Evaluation(score=float(reply.get("score") or 0.0), tests=reply.get("tests") or {})

    def heartbeat(self) -> Op:
        """Mark the lease as used, so the idle reaper leaves it (POST /heartbeat)."""
        yield from self._post("/heartbeat", idempotent=True)

    def close(self) -> Op:
        """Release the lease and queue its teardown (POST /close); whether it was still live
        (False when unknown or closed before: closing twice is harmless)."""
        return (yield from self._post("/close", idempotent=True)).get("found") is True


class _PoolOps(_Ops):
    """What Pool and AsyncPool share: settings, the retry policy and the pool-level operations."""

    _pool = property(lambda self: self)  # the pool drives its own operations
    _run_class: type
    _job_class: type
    _lease_class: type

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 8,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        job_timeout: float | None = 3600.0,
        headers: dict | None = None,
    ):
        """url: the termpool facade. token: POOL_API_TOKEN, when the service has one.
        timeout: seconds for one HTTP request (a long poll gets its wait on top).
        retries, backoff, max_backoff: how often and how patiently a retryable failure is
        sent again (delays backoff * 2^n, capped, with jitter; the defaults wait about two
        minutes in all, e.g. for a capacity slot). job_timeout: how long to wait for one job
        (None: no limit); a pool-API call may take that long on top of `timeout`."""
        self.url = url.rstrip("/")
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.job_timeout = job_timeout
        self._headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        self._timeout = timeout

    def _http_options(self) -> dict:
        return {"base_url": self.url, "headers": self._headers, "timeout": self._timeout}

    def _request_args(self, call: _Call) -> dict:
        return {
            "method": call.method,
            "url": call.path,
            "json": call.body,
            "params": call.params,
            "timeout": httpx.Timeout(
                self._timeout, read=None if call.long_poll is None else self._timeout + call.long_poll
            ),
        }

    def _retry_delay(self, call: _Call, error: TermpoolError, attempt: int) -> float | None:
        """Seconds to wait before sending `call` again, or None to give up."""
        refused = error.status == 429 or isinstance(error.__cause__, httpx.ConnectError)
        if attempt >= self.retries or not error.retryable or not (call.idempotent or refused):
            return None
        return min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)

    @staticmethod
    def _outcome(call: _Call, response: httpx.Response) -> dict | TermpoolError:
        try:
            body = response.json()
        except ValueError:
            body = {"error": f"{call.method} {call.path}: HTTP {response.status_code}: {response.text[:300]}"}
        if response.status_code in (200, 201, 202) and isinstance(body, dict) and body.get("ok") is not False:
            return body
        return _reply_error(response.status_code, body)

    def _unreachable(self, call: _Call, exc: httpx.TransportError) -> ServiceUnreachable:
        error = ServiceUnreachable(f"{call.method} {self.url}{call.path}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    # ---- operations (driven by the subclasses' _drive) ----------------------------------------
    def start(
        self,
        task: str,
        *,
        task_path: str | None = None,
        instruction: str | None = None,
        request_id: str | None = None,
        run_ctx: dict | None = None,
        task_timeouts: dict | None = None,
        task_key: str | None = None,
        wait: bool = True,
    ) -> Op:
        """Allocate a run of `task` (a folder of the service's DATASET_DIR) and start it; the
        Run, ready for tool calls (wait=False: at once; then run.wait_ready()). A start that
        fails releases the run and raises its typed error (TaskBuildFailed, ...)."""
        body = _run_body(task, task_path, instruction, request_id, run_ctx, task_timeouts, task_key)
        reply = yield from self._call("POST", "/v1/runs", body=body, idempotent=True)
        run = self._run_class(self, reply["run_id"], reply.get("job_id"))
        if not wait:
            return run
        try:
            result = (yield from _wait_job(self, reply["job_id"], self.job_timeout))["result"] or {}
        except TermpoolError as error:
            try:
                yield from _RunOps.close(run)  # free the slot of the failed start
            except TermpoolError:
                pass
            raise error
        run.user_msg, run.tool_schemas = result.get("user_msg"), result.get("tool_schemas")
        return run

    def episode(
        self,
        task: str,
        script: list[dict],
        *,
        evaluate: bool = True,
        close: bool = True,
        check: bool = True,
        timeout: float | None = None,
        task_path: str | None = None,
        instruction: str | None = None,
        request_id: str | None = None,
        run_ctx: dict | None = None,
        task_timeouts: dict | None = None,
        task_key: str | None = None,
    ) -> Op:
        """A whole episode in one request (an oracle or a replay): start, the script's tool
        calls (tool_call / exec_call / write_file_call), evaluation, close, run by the
        workers as one chain. Waits for every step; the Episode. A failed step raises its
        typed error (with .episode) when `check`, else is the Episode's `failure`. After
        `timeout` seconds (default: job_timeout per step) the run is closed and WaitTimeout
        raised."""
        body = _run_body(task, task_path, instruction, request_id, run_ctx, task_timeouts, task_key)
        body.update(script=list(script), evaluate=evaluate, close=close)
        reply = yield from self._call("POST", "/v1/runs", body=body, idempotent=True)
        run_id, steps = reply["run_id"], reply.get("jobs") or {}
        order = [
            steps.get("start") or reply["job_id"],
            *steps.get("tool_calls", []),
            *[steps[k] for k in ("evaluation", "close") if steps.get(k)],
        ]
        deadline = None if timeout is None else time.monotonic() + timeout
        jobs = []
        try:
            for job_id in order:  # in chain order: the current step first
                left = self.job_timeout if deadline is None else max(0.0, deadline - time.monotonic())
                jobs.append((yield from _wait_job(self, job_id, left, raise_failed=False)))
        except WaitTimeout as error:
            yield from self._call("DELETE", f"/v1/runs/{run_id}", idempotent=True)
            error.run_id = run_id
            raise
        run = (yield from self._call("GET", f"/v1/runs/{run_id}", idempotent=True))["run"]
        episode = _episode(run_id, run, jobs)
        if check and episode.failure is not None:
            episode.failure.episode = episode
            raise episode.failure
        return episode

    def run(self, run_id: str) -> Op:
        """A Run object for an existing run (e.g. one made elsewhere); UnknownRun if there is none."""
        record = yield from self._call("GET", f"/v1/runs/{run_id}", idempotent=True)
        return self._run_class(self, run_id, None, record["run"])

    def job(self, job_id: str):
        """A Job (AsyncJob) object for an existing job id."""
        return self._job_class(self, job_id)

    def allocate(self, task_key: str, *, request_id: str | None = None) -> Op:
        """A lease of the blocking pool API (POST /allocate), for `task_key`; reset() it with a
        task next. Sent again after a retryable failure: the request_id (random unless given)
        makes a repeat return the same lease."""
        body = {"task_key": task_key, "request_id": request_id or uuid.uuid4().hex}
        reply = yield from self._call("POST", "/allocate", body=body, idempotent=True)
        return self._lease_class(self, reply["lease_id"], reply.get("reused") is True)

    def lease(self, lease_id: str):
        """A Lease (AsyncLease) object for an existing lease id (a run's id on the runs API)."""
        return self._lease_class(self, lease_id)

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Op:
        """One HTTP request, sent once as is, with the pool's address, token and timeouts (the
        read may take job_timeout on top, as a pool-API call does): the httpx.Response, whatever
        its status, for callers that check the reply itself (its status code, headers, bytes).
        No retries and no typed errors: a failed connection raises httpx.TransportError."""
        return (yield _Call(method, path, body=json, params=params, long_poll=self.job_timeout))

    def status(self) -> Op:
        """The pool's capacity and live runs (GET /status)."""
        return (yield from self._call("GET", "/status", idempotent=True))["pool"]

    def healthy(self) -> Op:
        """True when the facade answers /healthz."""
        try:
            yield from self._call("GET", "/healthz")
        except TermpoolError:
            return False
        return True


# ---- blocking -------------------------------------------------------------------------------
class Job(_JobOps):
    """A submitted operation: wait() for its result, record() for its state."""

    wait = _blocking(_JobOps.wait)
    record = _blocking(_JobOps.record)


class _ClosedOnExit:
    """`with` closes it (a run, a lease) on exit."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except TermpoolError:
            if exc_type is None:  # never hide the error that ended the block
                raise


class Run(_ClosedOnExit, _RunOps):
    """One leased task environment. A context manager: closed (released) on exit."""

    submit = _blocking(_RunOps.submit)
    tool = _blocking(_RunOps.tool)
    exec = _blocking(_RunOps.exec)
    view = _blocking(_RunOps.view)
    write_to_process = _blocking(_RunOps.write_to_process)
    write_file = _blocking(_RunOps.write_file)
    evaluate = _blocking(_RunOps.evaluate)
    wait_ready = _blocking(_RunOps.wait_ready)
    info = _blocking(_RunOps.info)
    close = _blocking(_RunOps.close)


class Lease(_ClosedOnExit, _LeaseOps):
    """One lease of the blocking pool API (Pool.allocate). A context manager: closed on exit."""

    reset = _blocking(_LeaseOps.reset)
    tool = _blocking(_LeaseOps.tool)
    exec = _blocking(_LeaseOps.exec)
    view = _blocking(_LeaseOps.view)
    write_to_process = _blocking(_LeaseOps.write_to_process)
    write_file = _blocking(_LeaseOps.write_file)
    evaluate = _blocking(_LeaseOps.evaluate)
    heartbeat = _blocking(_LeaseOps.heartbeat)
    close = _blocking(_LeaseOps.close)


class Pool(_PoolOps):
    """A termpool service, driven with blocking calls (thread-safe: httpx.Client is)."""

    _run_class = Run
    _job_class = Job
    _lease_class = Lease

    def __init__(self, url: str = DEFAULT_URL, **options):
        super().__init__(url, **options)
        self._http = httpx.Client(**self._http_options())

    __init__.__doc__ = _PoolOps.__init__.__doc__

    start = _blocking(_PoolOps.start)
    episode = _blocking(_PoolOps.episode)
    run = _blocking(_PoolOps.run)
    allocate = _blocking(_PoolOps.allocate)
    request = _blocking(_PoolOps.request)
    status = _blocking(_PoolOps.status)
    healthy = _blocking(_PoolOps.healthy)

    def _drive(self, op: Op):
        # AsyncPool._drive is this loop with awaits: the one place the two drivers differ.
        try:
            step = next(op)
            while True:
                if isinstance(step, _Call):
                    try:
                        step = op.send(self._http.request(**self._request_args(step)))
                    except httpx.TransportError as exc:
                        step = op.throw(exc)
                else:
                    time.sleep(step)
                    step = op.send(None)
        except StopIteration as stop:
            return stop.value

    def close(self) -> None:
        """Close the HTTP connections (not the runs)."""
        self._http.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- asyncio --------------------------------------------------------------------------------
class _AsyncClosedOnExit:
    """`async with` closes it (a run, a lease) on exit."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self.close()
        except TermpoolError:
            if exc_type is None:  # never hide the error that ended the block
                raise


class AsyncJob(_JobOps):
    """A submitted operation: await wait() for its result, record() for its state."""

    wait = _awaitable(_JobOps.wait)
    record = _awaitable(_JobOps.record)


class AsyncRun(_AsyncClosedOnExit, _RunOps):
    """One leased task environment; `async with` closes it on exit."""

    submit = _awaitable(_RunOps.submit)
    tool = _awaitable(_RunOps.tool)
    exec = _awaitable(_RunOps.exec)
    view = _awaitable(_RunOps.view)
    write_to_process = _awaitable(_RunOps.write_to_process)
    write_file = _awaitable(_RunOps.write_file)
    evaluate = _awaitable(_RunOps.evaluate)
    wait_ready = _awaitable(_RunOps.wait_ready)
    info = _awaitable(_RunOps.info)
    close = _awaitable(_RunOps.close)


class AsyncLease(_AsyncClosedOnExit, _LeaseOps):
    """One lease of the blocking pool API (AsyncPool.allocate); `async with` closes it on exit."""

    reset = _awaitable(_LeaseOps.reset)
    tool = _awaitable(_LeaseOps.tool)
    exec = _awaitable(_LeaseOps.exec)
    view = _awaitable(_LeaseOps.view)
    write_to_process = _awaitable(_LeaseOps.write_to_process)
    write_file = _awaitable(_LeaseOps.write_file)
    evaluate = _awaitable(_LeaseOps.evaluate)
    heartbeat = _awaitable(_LeaseOps.heartbeat)
    close = _awaitable(_LeaseOps.close)


class AsyncPool(_PoolOps):
    """A termpool service for asyncio: many episodes from one process and one event loop.
    Same methods as Pool, as coroutines; `async with AsyncPool(url) as pool:`."""

    _run_class = AsyncRun
    _job_class = AsyncJob
    _lease_class = AsyncLease

    def __init__(self, url: str = DEFAULT_URL, *, max_connections: int = 100, **options):
        super().__init__(url, **options)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(limits=limits, **self._http_options())

    start = _awaitable(_PoolOps.start)
    episode = _awaitable(_PoolOps.episode)
    run = _awaitable(_PoolOps.run)
    allocate = _awaitable(_PoolOps.allocate)
    request = _awaitable(_PoolOps.request)
    status = _awaitable(_PoolOps.status)
    healthy = _awaitable(_PoolOps.healthy)

    async def _drive(self, op: Op):
        try:
            step = next(op)
            while True:
                if isinstance(step, _Call):
                    try:
                        step = op.send(await self._http.request(**self._request_args(step)))
                    except httpx.TransportError as exc:
                        step = op.throw(exc)
                else:
                    await asyncio.sleep(step)
                    step = op.send(None)
        except StopIteration as stop:
            return stop.value

    async def close(self) -> None:
        """Close the HTTP connections (not the runs)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncPool:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
