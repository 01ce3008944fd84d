"""Reply bodies of both HTTP faces, declared once as pydantic models: app/apidoc.py documents
them in /openapi.json; every field is in the reply, defaults too."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from app.fields import JobId, PriorityClass, RunId
from poolcore.failures import CODES

# ---- replies ------------------------------------------------------------------------------------
Code = Annotated[
    Literal[tuple(CODES)],
    Field(description="Failure code; x-error-codes lists each with its kind, retryability and status per face."),
]
Retryable = Annotated[
    bool,
    Field(
        description="True when running the episode again can help (an infrastructure error or full "
        "capacity); false for client and task errors."
    ),
]
# "lost": its worker host was lost, or its containers died with the host's last incarnation.
RunState = Literal[
    "allocated", "starting", "ready", "busy", "evaluating", "evaluated", "closing", "closed", "failed", "lost"
]
JobState = Literal["queued", "running", "succeeded", "failed"]


class ReplyBody(BaseModel):
    """A reply body: every field is in the reply, defaults too (so the schema requires them)."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class Error(ReplyBody):
    ok: Literal[False] = False
    error: str
    code: Code
    retryable: Retryable


class Reply(ReplyBody):
    """A successful reply; app/http.py's `ok` puts `"ok": true` first."""

    ok: Literal[True] = True


class PoolStatus(ReplyBody):
    model_config = ConfigDict(extra="allow")  # what Engine.status adds is answered too

    max_tasks: int
    active_tasks: int
    max_runs_per_task: int
    total_active_runs: int
    pending_closes: int
    tasks: dict[str, dict]
    hosts: dict[str, dict]


class StatusReply(Reply):
    pool: PoolStatus


class AllocateReply(Reply):
    lease_id: RunId
    reused: bool


class ResetReply(Reply):
    user_msg: str | None
    tool_schemas: list[dict] | None


class ExecToolReply(Reply):
    observation: str | None


class EvaluateReply(Reply):
    score: float | None


class CloseReply(Reply):
    found: bool = Field(description="False when unknown or already closed.")


class EpisodeJobs(ReplyBody):
    start: JobId
    tool_calls: list[JobId]
    evaluation: JobId | None
    close: JobId | None


class Submitted(Reply):
    model_config = ConfigDict(json_schema_serialization_defaults_required=False)  # jobs may be left out

    run_id: RunId
    job_id: JobId | None
    state: RunState
    reused: bool
    jobs: EpisodeJobs | None = Field(None, description="Every step's job, when this request started the run.")


class JobAccepted(Reply):
    job_id: JobId


class ForkAccepted(Reply):
    job_id: JobId = Field(description="The fork job; it succeeds once every child is ready.")
    run_ids: list[RunId] = Field(description="The children, state starting until the fork job ends.")


class ForkReply(Reply):
    lease_ids: list[RunId]


class Released(Reply):
    job_id: JobId
    found: Literal[True]


class AlreadyReleased(Reply):
    job_id: JobId | None
    found: Literal[False]
    state: RunState


class Run(ReplyBody):
    run_id: RunId
    task_key: str
    state: RunState
    host: str
    priority: PriorityClass | None = Field(None, description="The run's priority class (None: made before classes).")
    created_at: float
    last_used_at: float | None = None
    user_msg: str | None = None
    tool_schemas: list[dict] | None = None
    score: float | None = None
    tests: dict[str, Literal["passed", "failed"]] | None = Field(None, description="Test name -> outcome.")
    rewards: dict[str, float] | None = Field(
        None, description="A Harbor task's named rewards (reward.json / reward.txt); score is `reward`."
    )
    disk_limit: int | None = Field(
        None, description="Bytes the started run may hold on disk (CONTAINER_DISK_LIMIT or the task's own, the lower)."
    )
    error: str | None = None
    code: Code | None = None
    retryable: Retryable | None = None
    jobs: list[JobId] = Field(description="Job ids, oldest first.")
    parent: RunId | None = Field(None, description="The run this one was forked from.")
    children: list[RunId] | None = Field(None, description="Runs forked from this one.")
    fork_depth: int | None = Field(None, description="Forks between this run and a started one (1: a child).")
    processes: Literal["restarted", "carried"] | None = Field(
        None, description="A child's processes: restored from a checkpoint (carried) or started again (restarted)."
    )
    processes_reason: str | None = Field(None, description="Why a child's processes were restarted, not carried.")


class Job(ReplyBody):
    job_id: JobId
    run_id: RunId
    kind: Literal["start", "tool_call", "evaluation", "close", "fork", "command", "put_archive", "get_archive"]
    state: JobState
    result: Any = Field(
        None,
        description="start: {user_msg, tool_schemas}; tool_call: the observation text; evaluation: "
        "{score, tests} (and rewards, for a Harbor task); close: {containers_removed}; fork: {run_ids, "
        "processes, processes_reason, sessions_restarted}; command: {return_code, stdout, stderr, stdout_truncated, "
        "stderr_truncated, timed_out}; put_archive: {path, size}; get_archive: {size, path_type}.",
    )
    error: str | None = None
    code: Code | None = None
    retryable: Retryable | None = None
    attempts: int | None = Field(
        None, description="Tries so far: 1, plus one per automatic retry after a transient Docker failure."
    )
    queued_at: float
    started_at: float | None = None
    finished_at: float | None = None


class RunReply(Reply):
    run: Run


class JobReply(Reply):
    job: Job
