"""The client's exceptions: one class per code of termpool/codes.py, under one base per kind,
and how a failed reply or job becomes one."""

from __future__ import annotations

from typing import Any

from termpool.codes import CODES, HTTP_STATUS_CODES


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


class ForkTooDeep(ClientError):
    code = "FORK_TOO_DEEP"  # noqa: E701


class TaskArchiveInvalid(ClientError):
    code = "TASK_ARCHIVE_INVALID"  # noqa: E701


class TaskArchiveTooLarge(ClientError):
    code = "TASK_ARCHIVE_TOO_LARGE"  # noqa: E701


class UnknownTask(ClientError):
    code = "UNKNOWN_TASK"  # noqa: E701


class TaskHasNoTests(ClientError):
    code = "TASK_HAS_NO_TESTS"  # noqa: E701


class JobCancelled(ClientError):
    code = "JOB_CANCELLED"  # noqa: E701


class JobNotCancellable(ClientError):
    code = "JOB_NOT_CANCELLABLE"  # noqa: E701


class UnknownUser(ClientError):
    code = "UNKNOWN_USER"  # noqa: E701


class BadArchive(ClientError):
    code = "BAD_ARCHIVE"  # noqa: E701


class ArchiveNotFound(ClientError):
    code = "ARCHIVE_NOT_FOUND"  # noqa: E701


class ArchiveTooLarge(ClientError):
    code = "ARCHIVE_TOO_LARGE"  # noqa: E701


class PathNotFound(ClientError):
    code = "PATH_NOT_FOUND"  # noqa: E701


class NotADirectory(ClientError):
    code = "NOT_A_DIRECTORY"  # noqa: E701


class TaskSlotsExhausted(CapacityExhausted):
    code = "TASK_SLOTS_EXHAUSTED"  # noqa: E701


class RunSlotsExhausted(CapacityExhausted):
    code = "RUN_SLOTS_EXHAUSTED"  # noqa: E701


class TenantQuotaExceeded(CapacityExhausted):
    code = "TENANT_QUOTA_EXCEEDED"  # noqa: E701


class PriorityNotAllowed(ClientError):
    code = "PRIORITY_NOT_ALLOWED"  # noqa: E701


class HostDiskLow(CapacityExhausted):
    code = "HOST_DISK_LOW"  # noqa: E701


class HostNetworksExhausted(CapacityExhausted):
    code = "HOST_NETWORKS_EXHAUSTED"  # noqa: E701


class TaskInvalid(TaskError):
    code = "TASK_INVALID"  # noqa: E701


class TaskBuildFailed(TaskError):
    code = "TASK_BUILD_FAILED"  # noqa: E701


class TaskImageNotFound(TaskError):
    code = "TASK_IMAGE_NOT_FOUND"  # noqa: E701


class TaskStartFailed(TaskError):
    code = "TASK_START_FAILED"  # noqa: E701


class TaskUnsupported(TaskError):
    code = "TASK_UNSUPPORTED"  # noqa: E701


class TestsTimeout(TaskError):
    code = "TESTS_TIMEOUT"  # noqa: E701


class TestsUnparsable(TaskError):
    code = "TESTS_UNPARSABLE"  # noqa: E701


class RewardMissing(TaskError):
    code = "REWARD_MISSING"  # noqa: E701


class RunDiskLimit(TaskError):
    code = "RUN_DISK_LIMIT"  # noqa: E701


class BackendUnavailable(InfrastructureError):
    code = "BACKEND_UNAVAILABLE"  # noqa: E701


class RedisUnavailable(InfrastructureError):
    code = "REDIS_UNAVAILABLE"  # noqa: E701


class BackendFull(InfrastructureError):
    code = "BACKEND_FULL"  # noqa: E701


class DockerError(InfrastructureError):
    code = "DOCKER_ERROR"  # noqa: E701


class ContainerLost(InfrastructureError):
    code = "CONTAINER_LOST"  # noqa: E701


class WorkerLost(InfrastructureError):
    code = "WORKER_LOST"  # noqa: E701


class OperationTimeout(InfrastructureError):
    code = "TIMEOUT"  # noqa: E701


class HostLost(InfrastructureError):
    code = "HOST_LOST"  # noqa: E701


class WorkersDown(InfrastructureError):
    code = "WORKERS_DOWN"  # noqa: E701


class NotReady(InfrastructureError):
    code = "NOT_READY"  # noqa: E701


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


def reply_error(status: int, body: Any) -> TermpoolError:
    body = body if isinstance(body, dict) else {}
    code = body.get("code") or _STATUS_CODES.get(status, "INTERNAL")
    message = str(body.get("error") or f"HTTP {status}")
    return error_class(code)(message, code=code, retryable=body.get("retryable"), status=status, reply=body)


def job_error(job: dict) -> TermpoolError:
    code = job.get("code") or "INTERNAL"
    message = f"{job.get('kind') or 'job'} job {job.get('job_id')} failed: {job.get('error') or 'no reason given'}"
    return error_class(code)(message, code=code, retryable=job.get("retryable"), job=job)
