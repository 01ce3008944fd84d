"""The failure taxonomy: every failed job and every failed reply carries a code and whether
retrying the same request can help.

Three classes:
  * client errors: the request itself is wrong (bad input, unknown lease, run not ready);
    retrying it unchanged gives the same answer.
  * task errors: the task's own files or tests are broken (a Dockerfile that does not
    build, a service that exits, tests that time out). Not retryable: count the episode.
  * infrastructure errors: termpool or its backends failed (Docker or Redis unreachable, a
    worker process lost, a time limit of ours). Retryable: the episode says nothing about
    the policy, run it again.

The Docker side raises `Failure` subclasses where it knows what went wrong; `classify` maps
any other exception to a code by its type (never by its message text).
"""
from __future__ import annotations

from dataclasses import dataclass

import docker.errors
import requests.exceptions


@dataclass(frozen=True)
class Code:
    name: str
    kind: str  # "client", "task" or "infrastructure"
    retryable: bool
    meaning: str


CODES: dict[str, Code] = {c.name: c for c in (
    # client errors
    Code("BAD_REQUEST", "client", False, "the request body or a field is invalid"),
    Code("UNAUTHORIZED", "client", False, "missing or wrong bearer token"),
    Code("FORBIDDEN", "client", False, "the client address is not allowed"),
    Code("NOT_FOUND", "client", False, "no such route"),
    Code("METHOD_NOT_ALLOWED", "client", False, "the route does not take this method"),
    Code("PAYLOAD_TOO_LARGE", "client", False, "the request body is too large"),
    Code("UNKNOWN_LEASE", "client", False, "the lease is unknown or released (pool API)"),
    Code("UNKNOWN_RUN", "client", False, "no such run (runs API)"),
    Code("UNKNOWN_JOB", "client", False, "no such job (runs API)"),
    Code("RUN_NOT_READY", "client", False, "the run has not been started (reset) successfully"),
    Code("RUN_CLOSED", "client", False, "the run has been released"),
    Code("TASK_SLOTS_EXHAUSTED", "client", True, "WORKER_MAX_TASKS distinct task keys have live runs"),
    Code("RUN_SLOTS_EXHAUSTED", "client", True, "WORKER_MAX_RUNS_PER_TASK runs of this key are live"),
    # task errors: the task is broken, retrying does not help
    Code("TASK_INVALID", "task", False, "the task's files are missing or malformed (task.yaml, compose file)"),
    Code("TASK_BUILD_FAILED", "task", False, "an image of the task failed to build (or to pull)"),
    Code("TASK_START_FAILED", "task", False, "a service of the task exited or never became healthy"),
    Code("TASK_UNSUPPORTED", "task", False, "the task's files ask for something termpool refuses"),
    Code("TESTS_TIMEOUT", "task", False, "the task's tests did not finish within their time limit"),
    Code("TESTS_UNPARSABLE", "task", False, "the task's test output could not be parsed"),
    # infrastructure errors: retry the episode
    Code("BACKEND_UNAVAILABLE", "infrastructure", True, "Redis or the Docker engine could not be reached"),
    Code("DOCKER_ERROR", "infrastructure", True, "the Docker engine answered with a server error"),
    Code("WORKER_LOST", "infrastructure", True, "the worker process running the job died"),
    Code("TIMEOUT", "infrastructure", True, "an operation of termpool's did not finish within its time limit"),
    Code("HOST_LOST", "infrastructure", True, "the worker host of the run stopped answering"),
    Code("WORKERS_DOWN", "infrastructure", True, "no live worker consumes the queue this job needs"),
    Code("INTERNAL", "infrastructure", True, "an unexpected error in termpool (a bug: please report it)"),
)}


def retryable(code: str) -> bool:
    known = CODES.get(code)
    return known.retryable if known else False


def fields(code: str) -> dict:
    """What every failed reply and job record carries besides `error`."""
    return {"code": code, "retryable": retryable(code)}


ERROR_LIMIT = 4000  # characters of an error text kept in a record or reply


def cap(text: str, limit: int = ERROR_LIMIT) -> str:
    """An error text cut to `limit` characters: its head (the message) and its tail (the end
    of a log, where the cause usually is)."""
    if len(text) <= limit:
        return text
    head = limit // 4
    marker = f"\n... ({len(text) - limit} characters cut) ...\n"
    return text[:head] + marker + text[-(limit - head - len(marker)):]


class Failure(Exception):
    """An error whose code is known where it is raised."""

    code = "INTERNAL"

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output  # the relevant log tail, for the run's artifacts

    @property
    def retryable(self) -> bool:
        return retryable(self.code)


class TaskInvalid(Failure):
    code = "TASK_INVALID"


class TaskBuildFailed(Failure):
    code = "TASK_BUILD_FAILED"


class TaskStartFailed(Failure):
    code = "TASK_START_FAILED"


class TaskUnsupported(Failure):
    code = "TASK_UNSUPPORTED"


class TestsTimeout(Failure):
    code = "TESTS_TIMEOUT"


class TestsUnparsable(Failure):
    code = "TESTS_UNPARSABLE"


class DockerError(Failure):
    code = "DOCKER_ERROR"


class WorkerLost(Failure):
    code = "WORKER_LOST"


class OperationTimeout(Failure):
    code = "TIMEOUT"


def _unreachable(exc: BaseException) -> bool:
    kinds = (requests.exceptions.ConnectionError, ConnectionError)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kinds):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def classify(exc: BaseException) -> str:
    """The code of any exception a job may raise, by its type."""
    if isinstance(exc, Failure):
        return exc.code
    if _unreachable(exc):
        return "BACKEND_UNAVAILABLE"
    if isinstance(exc, (TimeoutError, requests.exceptions.Timeout)):
        return "TIMEOUT"
    if isinstance(exc, docker.errors.BuildError):
        return "TASK_BUILD_FAILED"
    if isinstance(exc, docker.errors.APIError):
        return "DOCKER_ERROR"
    return "INTERNAL"
