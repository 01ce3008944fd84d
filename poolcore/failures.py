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

The codes themselves are in termpool/codes.py (pure data, shared with the client). The
Docker side raises `Failure` subclasses where it knows what went wrong; `classify` maps
any other exception to a code by its type (never by its message text). The codes of the
docker SDK's exception types are registered by the Docker side (environments/docker_client.py,
`register_codes`), so that the facade, which imports this module, never loads the SDK.
"""

from __future__ import annotations

import requests.exceptions

from termpool.codes import CODES, Code, fields, retryable  # noqa: F401  (re-exported)

ERROR_LIMIT = 4000  # characters of an error text kept in a record or reply


def cap(text: str, limit: int = ERROR_LIMIT) -> str:
    """An error text cut to `limit` characters: its head (the message) and its tail (the end
    of a log, where the cause usually is)."""
    if len(text) <= limit:
        return text
    head = limit // 4
    marker = f"\n... ({len(text) - limit} characters cut) ...\n"
    return text[:head] + marker + text[-(limit - head - len(marker)) :]


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


class TenantQuotaExceeded(Failure):
    """A tenant's run needs a build while its max_builds are in flight (tasks/build_quota.py)."""

    code = "TENANT_QUOTA_EXCEEDED"


class TaskBuildFailed(Failure):
    code = "TASK_BUILD_FAILED"


class TaskImageNotFound(Failure):
    """The image the task names (a Harbor task's docker_image, TBENCH_DOCKER_PULL_PREFIX's name)
    exists in no registry: the task's fault, named in the error."""

    code = "TASK_IMAGE_NOT_FOUND"


class TaskStartFailed(Failure):
    code = "TASK_START_FAILED"


class TaskUnsupported(Failure):
    code = "TASK_UNSUPPORTED"


class TestsTimeout(Failure):
    code = "TESTS_TIMEOUT"


class TestsUnparsable(Failure):
    code = "TESTS_UNPARSABLE"


class RewardMissing(Failure):
    code = "REWARD_MISSING"


class RunDiskLimit(Failure):
    """The run's containers and folders hold more than its disk limit (tasks/disk_check.py)."""

    code = "RUN_DISK_LIMIT"


class UnknownTask(Failure):
    """An uploaded task expired before this host wrote out its folder (or was never stored)."""

    code = "UNKNOWN_TASK"


class TaskHasNoTests(Failure):
    """An evaluation of a bare Harbor environment: there is nothing to run."""

    code = "TASK_HAS_NO_TESTS"


class DockerError(Failure):
    code = "DOCKER_ERROR"


class ContainerLost(Failure):
    """The run's container stopped under it (its Docker engine restarted without live-restore,
    or it was removed): the run cannot go on; a new one can."""

    code = "CONTAINER_LOST"


class WorkerLost(Failure):
    code = "WORKER_LOST"


class OperationTimeout(Failure):
    code = "TIMEOUT"


class HeldOnThisHost(Failure):
    """A task that allows one live run per host found its subnet, address or port taken by
    another run of it here (one allocated under another task key): capacity, not a fault."""

    code = "RUN_SLOTS_EXHAUSTED"


class NetworksExhausted(Failure):
    """Every block of the host's run-network range is held: capacity, not a fault (429)."""

    code = "HOST_NETWORKS_EXHAUSTED"


# Library exception types -> code, in registration order (the first that matches wins).
_CODES_BY_TYPE: list[tuple[type[BaseException], str]] = []
# A backend's own "could not reach it" types -> its code (Redis's: REDIS_UNAVAILABLE), checked
# along the exception's chain before the generic connection errors, which mean Docker.
_UNREACHABLE_BY_TYPE: list[tuple[type[BaseException], str]] = []
# What a failed job's text starts with, naming the component that could not be reached.
UNREACHABLE_PREFIX = {"BACKEND_UNAVAILABLE": "Docker is unreachable", "REDIS_UNAVAILABLE": "Redis is unreachable"}


def register_codes(codes: dict[type[BaseException], str]) -> None:
    """Give a library's exception types their codes (checked after termpool's own failures,
    unreachable backends and timeouts). Registering a type again keeps its first code."""
    known = {kind for kind, _ in _CODES_BY_TYPE}
    for kind, code in codes.items():
        if code not in CODES:
            raise ValueError(f"unknown failure code {code!r}")
        if kind not in known:
            _CODES_BY_TYPE.append((kind, code))


def register_unreachable(kinds: tuple[type[BaseException], ...], code: str) -> None:
    """Name the component behind a library's connection errors: an exception of `kinds`
    anywhere in a failure's chain (the outermost known one decides) gets `code`."""
    if code not in CODES:
        raise ValueError(f"unknown failure code {code!r}")
    known = {kind for kind, _ in _UNREACHABLE_BY_TYPE}
    _UNREACHABLE_BY_TYPE.extend((kind, code) for kind in kinds if kind not in known)


def _unreachable(exc: BaseException) -> str | None:
    """The code of the component that could not be reached, walking the chain outermost
    first: a Redis timeout whose cause is a refused socket is Redis's, not Docker's."""
    generic = (requests.exceptions.ConnectionError, ConnectionError)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for kind, code in _UNREACHABLE_BY_TYPE:
            if isinstance(exc, kind):
                return code
        if isinstance(exc, generic):
            return "BACKEND_UNAVAILABLE"
        exc = exc.__cause__ or exc.__context__
    return None


def classify(exc: BaseException) -> str:
    """The code of any exception a job may raise, by its type."""
    if isinstance(exc, Failure):
        return exc.code
    unreachable = _unreachable(exc)
    if unreachable:
        return unreachable
    if isinstance(exc, (TimeoutError, requests.exceptions.Timeout)):
        return "TIMEOUT"
    for kind, code in _CODES_BY_TYPE:
        if isinstance(exc, kind):
            return code
    return "INTERNAL"


def describe(exc: BaseException, code: str) -> str:
    """A failed job's text: the message, with the exception type where the message alone would
    not say what failed, after the component for an unreachable one; cut to ERROR_LIMIT."""
    text = str(exc).strip() or type(exc).__name__
    if not isinstance(exc, (Failure, TimeoutError)):
        text = f"{type(exc).__name__}: {text}"
    prefix = UNREACHABLE_PREFIX.get(code)
    if prefix and not text.startswith(prefix):
        text = f"{prefix}: {text}"
    return cap(text)
