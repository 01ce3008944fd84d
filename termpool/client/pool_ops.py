"""The pool's side of the protocol, sans-IO like ops.py: its settings, the retry policy and
the pool-level operations, written once for Pool (sync.py) and AsyncPool (aio.py)."""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any

import httpx

from termpool.client.calls import Episode, task_meta
from termpool.client.errors import ServiceUnreachable, TermpoolError, WaitTimeout, job_error, reply_error
from termpool.client.ops import RunOps
from termpool.client.protocol import Call, Hangup, Op, Operations, start_options, wait_job
from termpool.client.task_tar import TAR_GZ, folder_archive

DEFAULT_URL = "http://127.0.0.1:18081"


def _run_body(
    task: str,
    task_path: str | None,
    instruction: str | None,
    request_id: str | None,
    run_ctx: dict | None,
    task_timeouts: dict | None,
    task_key: str | None,
    priority: str | None = None,
) -> dict:
    body = {
        "task_key": task_key or task,
        "task_meta": task_meta(task, task_path, instruction),
        "request_id": request_id or uuid.uuid4().hex,
        **({"priority": priority} if priority else {}),
    }
    return {**body, **start_options(run_ctx, task_timeouts)}


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
        failure=job_error(failed[0]) if failed else None,
    )


class PoolOps(Operations):
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

    def _request_args(self, call: Call) -> dict:
        body = (
            {"json": call.body}
            if call.content is None
            else {"content": call.content, "headers": {"Content-Type": call.content_type}}
        )
        if call.key:
            body["headers"] = {**body.get("headers", {}), "Idempotency-Key": call.key}
        return {
            "method": call.method,
            "url": call.path,
            **body,
            "params": call.params,
            "timeout": httpx.Timeout(
                self._timeout, read=None if call.long_poll is None else self._timeout + call.long_poll
            ),
        }

    def _retry_delay(self, call: Call, error: TermpoolError, attempt: int) -> float | None:
        """Seconds to wait before sending `call` again, or None to give up."""
        refused = error.status == 429 or isinstance(error.__cause__, httpx.ConnectError)
        # A request with an Idempotency-Key does its work once however often it is sent: one
        # whose reply was lost, or that met Redis away, is sent again too.
        keyed = call.key and (isinstance(error.__cause__, httpx.TransportError) or error.code == "REDIS_UNAVAILABLE")
        if attempt >= self.retries or not error.retryable or not (call.idempotent or refused or keyed):
            return None
        return min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)

    @staticmethod
    def _outcome(call: Call, response: httpx.Response) -> dict | bytes | TermpoolError:
        if call.raw_reply and response.status_code == 200:
            return response.content
        try:
            body = response.json()
        except ValueError:
            body = {"error": f"{call.method} {call.path}: HTTP {response.status_code}: {response.text[:300]}"}
        if response.status_code in (200, 201, 202) and isinstance(body, dict) and body.get("ok") is not False:
            return body
        return reply_error(response.status_code, body)

    def _unreachable(self, call: Call, exc: httpx.TransportError) -> ServiceUnreachable:
        error = ServiceUnreachable(f"{call.method} {self.url}{call.path}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    # ---- operations (each driver makes them its methods: drivers.py) --------------------------
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
        priority: str | None = None,
    ) -> Op:
        """Allocate a run of `task` (a folder of the service's DATASET_DIR, or an uploaded task:
        task_path=pool.upload_task(folder)) and start it; the
        Run, ready for tool calls (wait=False: at once; then run.wait_ready()). A start that
        fails releases the run and raises its typed error (TaskBuildFailed, ...). `priority`:
        the run's class, "eval" or "train" (default: the tenant's; PriorityNotAllowed above it)."""
        body = _run_body(task, task_path, instruction, request_id, run_ctx, task_timeouts, task_key, priority)
        reply = yield from self._call("POST", "/v1/runs", body=body, idempotent=True)
        run = self._run_class(self, reply["run_id"], reply.get("job_id"))
        if not wait:
            return run
        try:
            result = (yield from wait_job(self, reply["job_id"], self.job_timeout))["result"] or {}
        except TermpoolError as error:
            try:
                yield from RunOps.close(run)  # free the slot of the failed start
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
        priority: str | None = None,
    ) -> Op:
        """A whole episode in one request (an oracle or a replay): start, the script's tool
        calls (tool_call / exec_call / write_file_call), evaluation, close, run by the
        workers as one chain. Waits for every step; the Episode. A failed step raises its
        typed error (with .episode) when `check`, else is the Episode's `failure`. After
        `timeout` seconds (default: job_timeout per step) the run is closed and WaitTimeout
        raised. `priority`: as for start()."""
        body = _run_body(task, task_path, instruction, request_id, run_ctx, task_timeouts, task_key, priority)
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
                jobs.append((yield from wait_job(self, job_id, left, raise_failed=False)))
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

    def upload_task(self, folder: str | os.PathLike) -> Op:
        """Send a task folder (terminal-bench, Harbor, or a bare Harbor environment) to the pool
        (POST /v1/tasks, a deterministic tar.gz of it); its task_path "sha256:<hex>", to give
        start() / episode() / Lease.reset() as task_path. The same content gives the same
        task_path and is stored once, so sending it again is harmless (and restarts its lifetime)."""
        archive = folder_archive(folder)
        reply = yield from self._call("POST", "/v1/tasks", content=archive, content_type=TAR_GZ, idempotent=True)
        return reply["task_path"]

    def run(self, run_id: str) -> Op:
        """A Run object for an existing run (e.g. one made elsewhere); UnknownRun if there is none."""
        record = yield from self._call("GET", f"/v1/runs/{run_id}", idempotent=True)
        return self._run_class(self, run_id, None, record["run"])

    def job(self, job_id: str):
        """A Job (AsyncJob) object for an existing job id."""
        return self._job_class(self, job_id)

    def allocate(self, task_key: str, *, request_id: str | None = None, priority: str | None = None) -> Op:
        """A lease of the blocking pool API (POST /allocate), for `task_key`; reset() it with a
        task next. Sent again after a retryable failure: the request_id (random unless given)
        makes a repeat return the same lease. `priority`: as for start()."""
        body = {"task_key": task_key, "request_id": request_id or uuid.uuid4().hex}
        if priority:
            body["priority"] = priority
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
        return (yield Call(method, path, body=json, params=params, long_poll=self.job_timeout))

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

    def ready(self) -> Op:
        """True when /readyz answers 200: a worker host serves every queue kind. Asked once,
        without retries, as a probe asks. Work sent before is not refused: it waits in its queue."""
        try:
            reply = yield Call("GET", "/readyz")
        except httpx.TransportError:
            return False
        return reply.status_code == 200

    def close(self) -> Op:
        """Close the HTTP connections (not the runs)."""
        yield Hangup()

    def _exit(self, exc_type, exc, tb) -> Op:
        """Leaving a `with` (`async with`) block: close the connections."""
        yield Hangup()
