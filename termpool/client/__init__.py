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

The package needs only httpx and termpool/codes.py (pure data): nothing of the server's.
errors.py: the exceptions; calls.py: tool calls and results; protocol.py: the request
machinery every operation uses; ops.py, pool_ops.py: the protocol as sans-IO operations
(commands.py: Run.command, archives.py: file transfers, both mixed into the runs');
drivers.py: how both clients run them; sync.py: Pool, Run, Lease, Job; aio.py: AsyncPool,
AsyncRun, AsyncLease, AsyncJob.
"""

from termpool.client.aio import AsyncJob, AsyncLease, AsyncPool, AsyncRun
from termpool.client.calls import Episode, Evaluation, exec_call, task_meta, tool_call, write_file_call
from termpool.client.commands import CommandResult
from termpool.client.errors import (
    ArchiveNotFound,
    ArchiveTooLarge,
    BackendFull,
    BackendUnavailable,
    BadArchive,
    BadRequest,
    CapacityExhausted,
    ClientError,
    ContainerLost,
    DockerError,
    Forbidden,
    ForkTooDeep,
    HostDiskLow,
    HostLost,
    HostNetworksExhausted,
    InfrastructureError,
    InternalError,
    JobCancelled,
    JobNotCancellable,
    MethodNotAllowed,
    NotADirectory,
    NotFound,
    NotReady,
    OperationTimeout,
    PathNotFound,
    PayloadTooLarge,
    PriorityNotAllowed,
    RedisUnavailable,
    RewardMissing,
    RunClosed,
    RunDiskLimit,
    RunNotReady,
    RunSlotsExhausted,
    ServiceUnreachable,
    TaskArchiveInvalid,
    TaskArchiveTooLarge,
    TaskBuildFailed,
    TaskError,
    TaskHasNoTests,
    TaskImageNotFound,
    TaskInvalid,
    TaskSlotsExhausted,
    TaskStartFailed,
    TaskUnsupported,
    TenantQuotaExceeded,
    TermpoolError,
    TestsTimeout,
    TestsUnparsable,
    Unauthorized,
    UnknownJob,
    UnknownLease,
    UnknownRun,
    UnknownTask,
    UnknownUser,
    WaitTimeout,
    WorkerLost,
    WorkersDown,
    error_class,
)
from termpool.client.pool_ops import DEFAULT_URL
from termpool.client.sync import Job, Lease, Pool, Run

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
    "CommandResult",
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
    # the rest of the classes, one per code (errors.py), and the default address: importable
    # from here as they were from the single module
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "MethodNotAllowed",
    "PayloadTooLarge",
    "UnknownLease",
    "UnknownRun",
    "UnknownJob",
    "RunNotReady",
    "RunClosed",
    "ForkTooDeep",
    "TaskArchiveInvalid",
    "TaskArchiveTooLarge",
    "UnknownTask",
    "TaskHasNoTests",
    "JobCancelled",
    "JobNotCancellable",
    "UnknownUser",
    "BadArchive",
    "ArchiveNotFound",
    "ArchiveTooLarge",
    "PathNotFound",
    "NotADirectory",
    "TaskSlotsExhausted",
    "RunSlotsExhausted",
    "TenantQuotaExceeded",
    "PriorityNotAllowed",
    "TaskInvalid",
    "TaskBuildFailed",
    "TaskImageNotFound",
    "TaskStartFailed",
    "TaskUnsupported",
    "TestsTimeout",
    "TestsUnparsable",
    "RewardMissing",
    "BackendFull",
    "RunDiskLimit",
    "HostDiskLow",
    "HostNetworksExhausted",
    "BackendUnavailable",
    "RedisUnavailable",
    "ContainerLost",
    "DockerError",
    "WorkerLost",
    "OperationTimeout",
    "HostLost",
    "WorkersDown",
    "NotReady",
    "InternalError",
    "DEFAULT_URL",
]
