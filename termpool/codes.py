"""The failure codes: which failures exist, their kind, and whether a retry can help.

Pure data with no dependencies, so the client (termpool/client/) can use it on a trainer
machine that has none of the server's packages; poolcore/failures.py (the server side)
builds its exceptions and classifier on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    name: str
    kind: str  # "client", "task" or "infrastructure"
    retryable: bool
    meaning: str


CODES: dict[str, Code] = {
    c.name: c
    for c in (
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
        Code(
            "TENANT_QUOTA_EXCEEDED",
            "client",
            True,
            "a tenant quota: its max_runs are live, the free slots left are reserved for other tenants, a start "
            "needs a build while its max_builds are in flight, or an upload would pass its max_upload_bytes",
        ),
        Code(
            "PRIORITY_NOT_ALLOWED",
            "client",
            False,
            "the run asked for a priority class above its tenant's (a run may only ask for its own or a lower one)",
        ),
        Code(
            "HOST_NETWORKS_EXHAUSTED",
            "client",
            True,
            "every block of the host's RUN_SUBNETS is held by a live run: a compose run's networks cannot be made",
        ),
        Code("HOST_DISK_LOW", "client", True, "every host that could take the run is under HOST_DISK_MIN_FREE"),
        Code("FORK_TOO_DEEP", "client", False, "the run is a fork FORK_MAX_DEPTH deep: it cannot be forked"),
        Code(
            "TASK_ARCHIVE_INVALID",
            "client",
            False,
            "an uploaded task archive is unreadable, unsafe (names or links leaving the folder, hard links, "
            "devices) or not a task of either format; nothing was stored",
        ),
        Code(
            "TASK_ARCHIVE_TOO_LARGE",
            "client",
            False,
            "an uploaded task unpacks to more than UPLOADED_TASK_MAX_BYTES or UPLOADED_TASK_MAX_FILES; nothing was stored",
        ),
        Code(
            "UNKNOWN_TASK",
            "client",
            False,
            "task_path names an uploaded task (sha256:...) the pool does not hold: never uploaded, or expired",
        ),
        Code("TASK_HAS_NO_TESTS", "client", False, "an evaluation of a bare Harbor environment, which has no tests"),
        Code("JOB_CANCELLED", "client", False, "the client cancelled the job (DELETE /v1/jobs/<id>) before it ended"),
        Code("JOB_NOT_CANCELLABLE", "client", False, "only a command job can be cancelled"),
        Code("UNKNOWN_USER", "client", False, "a command's user does not exist in the run's container"),
        Code("BAD_ARCHIVE", "client", False, "an uploaded archive is not a plain tar, or a member of it is refused"),
        Code("ARCHIVE_NOT_FOUND", "client", False, "the job has no archive to read: not a finished export, or expired"),
        Code("ARCHIVE_TOO_LARGE", "client", False, "the path's archive is larger than ARCHIVE_MAX_BYTES"),
        Code("PATH_NOT_FOUND", "client", False, "no such path in the run's container"),
        Code("NOT_A_DIRECTORY", "client", False, "an archive's target path (or a parent of it) is not a directory"),
        # task errors: the task is broken, retrying does not help
        Code("TASK_INVALID", "task", False, "the task's files are missing or malformed (task.yaml, compose file)"),
        Code("TASK_BUILD_FAILED", "task", False, "an image of the task failed to build (or to pull)"),
        Code(
            "TASK_IMAGE_NOT_FOUND",
            "task",
            False,
            "the image the task names exists in no registry (its name is in the error)",
        ),
        Code("TASK_START_FAILED", "task", False, "a service of the task exited or never became healthy"),
        Code("TASK_UNSUPPORTED", "task", False, "the task's files ask for something termpool refuses"),
        Code("TESTS_TIMEOUT", "task", False, "the task's tests did not finish within their time limit"),
        Code("TESTS_UNPARSABLE", "task", False, "the task's test output could not be parsed"),
        Code("REWARD_MISSING", "task", False, "a Harbor task's verifier wrote no usable reward file"),
        Code("RUN_DISK_LIMIT", "task", False, "the run wrote more than its disk limit; it was ended and removed"),
        # infrastructure errors: retry the episode
        Code("BACKEND_UNAVAILABLE", "infrastructure", True, "a worker could not reach its Docker engine"),
        Code(
            "REDIS_UNAVAILABLE",
            "infrastructure",
            True,
            "Redis (run state and job queues) could not be reached within the call's limit",
        ),
        Code(
            "BACKEND_FULL",
            "infrastructure",
            True,
            "Redis refused a write: it is at its memory limit (maxmemory with noeviction)",
        ),
        Code("DOCKER_ERROR", "infrastructure", True, "the Docker engine answered with a server error"),
        Code("WORKER_LOST", "infrastructure", True, "the worker process running the job died"),
        Code("TIMEOUT", "infrastructure", True, "an operation of termpool's did not finish within its time limit"),
        Code("HOST_LOST", "infrastructure", True, "the worker host of the run stopped answering"),
        Code(
            "CONTAINER_LOST",
            "infrastructure",
            True,
            "the run's container stopped under it (its Docker engine restarted, or it was removed): start a new run",
        ),
        Code("WORKERS_DOWN", "infrastructure", True, "no live worker consumes the queue this job needs"),
        Code("NOT_READY", "infrastructure", True, "no worker host serves every queue kind yet (GET /readyz only)"),
        Code("INTERNAL", "infrastructure", True, "an unexpected error in termpool (a bug: please report it)"),
    )
}


def retryable(code: str) -> bool:
    known = CODES.get(code)
    return known.retryable if known else False


def fields(code: str) -> dict:
    """What every failed reply and job record carries besides `error`."""
    return {"code": code, "retryable": retryable(code)}


# The code a plain HTTP refusal means (the facade's own errors, and a reply without a code).
HTTP_STATUS_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "PAYLOAD_TOO_LARGE",
}
