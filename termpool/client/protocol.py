"""The request machinery every operation is written with (ops.py, pool_ops.py, commands.py,
archives.py), sans-IO: what an operation may yield (a Call, a pause, a Hangup, an OnCancel),
one request with its retries (`request_op`), the long-poll of a job (`wait_job`), and the base
of the objects whose methods are operations. `pool` below is the PoolOps (pool_ops.py) that
drives an operation: its retry policy (_retry_delay) and the reading of replies (_outcome)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import httpx

from termpool.client.errors import TermpoolError, WaitTimeout, job_error

MAX_LONG_POLL = 60.0  # the runs API's upper bound for ?wait=
JOB_ENDED = ("succeeded", "failed")


@dataclass(frozen=True)
class Call:
    """One HTTP request. `idempotent`: sending it twice does the work once."""

    method: str
    path: str
    body: dict | None = None
    params: dict | None = None
    idempotent: bool = False
    long_poll: float | None = 0.0  # seconds the server may hold the reply (None: no limit)
    content: bytes | None = None  # a raw body in place of `body`'s JSON (a tar archive)
    content_type: str = "application/x-tar"
    raw_reply: bool = False  # a successful reply is its bytes (a tar archive), not JSON
    key: str | None = None  # an Idempotency-Key: the request queues its job once, however often sent


def queuing(method: str, path: str, body: dict | None = None) -> Call:
    """A request that queues a job, made safe to send again by its own Idempotency-Key: a retry
    after a lost reply (pool._retry_delay) answers the first request's job."""
    return Call(method, path, body=body, key=uuid.uuid4().hex)


@dataclass(frozen=True)
class Hangup:
    """Close the pool's HTTP connections (not its runs)."""


@dataclass(frozen=True)
class OnCancel:
    """From here on, should its caller abandon the operation (an asyncio task cancelled, Ctrl-C
    in a blocking call), send `call` before the cancellation goes on: shielded, best effort,
    within CANCEL_SECONDS (drivers.py). None: nothing any more."""

    call: Call | None


# An operation is a generator that yields what to do (an HTTP request: a Call; a pause: a
# number of seconds; closing the connections: a Hangup; what to send if it is abandoned: an
# OnCancel) and is sent the outcome (an httpx.Response, or has the transport error thrown
# in; None for the others); it returns its result. Pool drives
# operations with blocking I/O, AsyncPool with awaited I/O (drivers.py), so the protocol,
# retries included, is written once.
Op = Generator[Any, Any, Any]


def request_op(pool, call: Call) -> Op:
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


def wait_job(pool, job_id: str, timeout: float | None, raise_failed: bool = True) -> Op:
    """Long-poll a job until it ends; its record. A failed job raises its typed error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = MAX_LONG_POLL if deadline is None else deadline - time.monotonic()
        wait = round(max(0.0, min(MAX_LONG_POLL, left)), 1)
        reply = yield from request_op(
            pool, Call("GET", f"/v1/jobs/{job_id}", params={"wait": wait}, idempotent=True, long_poll=wait)
        )
        job = reply["job"]
        if job.get("state") == "failed" and raise_failed:
            raise job_error(job)
        if job.get("state") in JOB_ENDED:
            return job
        if left <= 0:
            raise WaitTimeout(f"job {job_id} ({job.get('kind')}) is still {job.get('state')} after {timeout:g} s")


def start_options(run_ctx: dict | None, task_timeouts: dict | None) -> dict:
    """A start's optional fields, when given (both faces take them the same way)."""
    return {k: v for k, v in (("run_ctx", run_ctx), ("task_timeouts", task_timeouts)) if v}


class Operations:
    """Base of the objects whose methods are operations; `_pool` drives them."""

    _pool: Any  # the PoolOps that drives them

    def _call(self, method: str, path: str, **options) -> Op:
        return (yield from request_op(self._pool, Call(method, path, **options)))

    def _enter(self) -> Op:
        """Entering a `with` (`async with`) block: no I/O, the object itself."""
        yield from ()
        return self
