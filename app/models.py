"""Request and reply bodies of both HTTP faces, declared once as pydantic models.

The routes validate every body with these models (app/http.py: `operation`) and
app/apidoc.py builds /openapi.json from the same models, so the checks and the document
cannot drift. A failed validation is answered 400 with one readable text made by `explain`
from the first error ("task_meta.task_path is longer than 1024 characters").

Paths (task_meta.task_path, run_ctx.log_dir) are resolved while validating: the validation
context holds the settings (`{"cfg": Settings}`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from termpool import priorities, uploaded_tasks
from termpool.failures import CODES
from termpool.paths import PathError, resolve_log_dir, resolve_task_path
from termpool.task_spec import MAX_TASK_NAME_LENGTH, TASK_NAME_PATTERN, is_task_dir

# ---- limits -------------------------------------------------------------------------------------
MAX_BODY_BYTES = 8 << 20  # Flask's MAX_CONTENT_LENGTH: a larger body is answered 413
MAX_JSON_DEPTH = 64  # arrays and objects nested in a body, the body itself counting as 1
MAX_ID_LENGTH = 256  # task_key, request_id, lease_id, tool names
MAX_UID_LENGTH = 128  # run_ctx.uid, group_index, sample_index: uid is part of the run's log folder name
MAX_PATH_LENGTH = 1024  # task_path, log_dir
MAX_PATH_PART_BYTES = 255  # one component of a path (the file systems' NAME_MAX)
MAX_TEXT_LENGTH = 1 << 20  # task_meta.instruction
MIN_INTEGER, MAX_INTEGER = -(2**63), 2**63 - 1  # ids given as integers
MAX_SCRIPT_STEPS = 1000  # each step of a Celery chain carries the rest of the chain in its message
MAX_SCRIPT_BYTES = 1 << 20
MAX_WAIT = 60.0  # ?wait of GET /v1/jobs/<id>
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"  # C0, DEL and C1: NUL, tab, newline, ESC, ...
PRINTABLE_PATTERN = f"^[^{CONTROL_CHARACTERS}]*$"
TEXT_PATTERN = r"^[^\x00]*$"  # free text: newlines and tabs are fine, NUL is not
RUN_ID_PATTERN = r"^run-[0-9a-f]{16}$"
JOB_ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
TASK_NAME_TEXT = (
    f"must be letters and digits joined by '-', '.' or '_', at most {MAX_TASK_NAME_LENGTH} characters: "
    "it names the task's Docker images and containers"
)


# ---- error texts --------------------------------------------------------------------------------
def refuse(text: str) -> PydanticCustomError:
    """A validation error whose text is ours, shown after the field's name (right after it when
    the text starts with ':', as in "task_meta.task_path: no task.yaml in ...")."""
    return PydanticCustomError("refused", "{text}", {"text": text})


TEXTS = {  # pydantic error type -> the text after the field's name
    "missing": "is required",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "string_too_long": "is longer than {max_length} characters",
    "model_type": "must be a dict",
    "model_attributes_type": "must be a dict",
    "dict_type": "must be a dict",
    "list_type": "must be a list",
    "too_long": "has {actual_length} items; at most {max_length} are allowed",
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
}
PATTERN_TEXTS = {
    PRINTABLE_PATTERN: "must not contain control characters",
    TEXT_PATTERN: "must not contain a NUL character",
}
ITEM_NAMES = {"script": "tool_call"}  # what an item of a list field is called in a text


def explain(exc: ValidationError, root: str = "") -> str:
    """One text for the first error: where (the field, `root` for the body) and what."""
    error = exc.errors(include_url=False)[0]
    ctx = error.get("ctx") or {}
    if error["type"] == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_TEXTS:
        text = PATTERN_TEXTS[ctx["pattern"]]
    elif error["type"] in TEXTS:
        text = TEXTS[error["type"]].format(**ctx)
    else:
        text = error["msg"]
    where = _where(error["loc"], root)
    if not where:
        return f"the request body {text}"
    return f"{where}{'' if text.startswith(':') else ' '}{text}"


def _where(loc: tuple, root: str) -> str:
    """('script', 1, 'name') -> "script[1]: tool_call.name"; a list item takes its ITEM_NAMES name."""
    parts = [root] if root else []
    for item in loc:
        if isinstance(item, int):
            name = ITEM_NAMES.get(parts[-1], "item") if parts else "item"
            parts = [f"{'.'.join(parts)}[{item}]:", name]
        else:
            parts.append(str(item))
    return ".".join(parts).replace(":.", ": ")


# ---- field types --------------------------------------------------------------------------------
def _present(value):
    """A required id: null and "" count as absent ("lease_id is required")."""
    if value is None or value == "":
        raise PydanticCustomError("missing", "Field required")
    return value


def _scalar_id(value, handler):
    """A string or an integer; one error for the branch the value's type picks."""
    if isinstance(value, float) and value.is_integer():  # JSON Schema's integers include 7.0
        value = int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
        raise refuse("must be a string or an integer")
    try:
        return handler(value)
    except ValidationError as exc:
        if isinstance(value, int):
            raise refuse("must be an integer of at most 64 bits") from None
        branch = [e for e in exc.errors() if e["type"] != "int_type"][0]  # the string's own error
        raise PydanticCustomError(branch["type"], branch["msg"], branch.get("ctx")) from None


def _scalar(max_length: int):
    """An optional id given as a string or an integer (request_id, run_ctx.uid)."""
    text = Annotated[StrictStr, Field(max_length=max_length, pattern=PRINTABLE_PATTERN)]
    number = Annotated[StrictInt, Field(ge=MIN_INTEGER, le=MAX_INTEGER)]
    return Annotated[text | number | None, WrapValidator(_scalar_id)]


def _path(min_length: int | None):
    """A path inside a root folder (resolved by the model's validator): printable, short parts."""
    constraints = Field(min_length=min_length, max_length=MAX_PATH_LENGTH, pattern=PRINTABLE_PATTERN)
    return Annotated[StrictStr, constraints, AfterValidator(_path_parts)]


def _task_name(value, handler):
    _present(value)
    try:
        return handler(value)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "string_type":
            raise
        raise refuse(TASK_NAME_TEXT) from None


def _tool_name(value):
    if not isinstance(value, str) or not value:
        raise refuse("must be a non-empty string")
    return value


def _path_parts(value: str) -> str:
    if any(len(part.encode()) > MAX_PATH_PART_BYTES for part in value.split("/")):
        raise refuse(f"has a component longer than {MAX_PATH_PART_BYTES} bytes")
    return value


Id = Annotated[
    StrictStr,
    Field(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=PRINTABLE_PATTERN,
        description="Printable: no control characters.",
    ),
    BeforeValidator(_present),
]
LeaseId = Annotated[Id, Field(description="The run id from /allocate.")]
ScalarId = _scalar(MAX_ID_LENGTH)
RunCtxId = _scalar(MAX_UID_LENGTH)
TaskName = Annotated[
    StrictStr,
    Field(
        min_length=1,
        max_length=MAX_TASK_NAME_LENGTH,
        pattern=TASK_NAME_PATTERN,
        description="Names the task's Docker images and containers: letters and digits joined by '-', '.' "
        "or '_' (one or two).",
    ),
    WrapValidator(_task_name),
]
TaskPath = _path(min_length=1)
LogDir = _path(min_length=None)  # "": the default folder
ToolName = Annotated[
    StrictStr,
    Field(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=PRINTABLE_PATTERN,
        description="Printable. An unknown name is not an HTTP error: the observation says so.",
    ),
    BeforeValidator(_tool_name),
]
RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN)]
JobId = Annotated[str, Field(pattern=JOB_ID_PATTERN)]
WaitSeconds = Annotated[float, Field(ge=0, le=MAX_WAIT, allow_inf_nan=False)]
Flag = Annotated[StrictBool | None, AfterValidator(bool)]  # null: false
Seconds = Annotated[Any, Field(description="Seconds; a value that is not a positive number is ignored.")]


def text_id(value: str | int | None) -> str:
    """A scalar id as the store keeps it: "" when absent."""
    return "" if value is None else str(value)


def _resolve(value: str, resolve) -> Path:
    try:
        return resolve(value)
    except PathError as exc:
        raise refuse(f": {exc}") from None
    except OSError as exc:
        raise refuse(f": {exc.strerror or exc}") from None


def _settings(info: ValidationInfo):
    return (info.context or {})["cfg"]


# ---- requests -----------------------------------------------------------------------------------
class TaskMeta(BaseModel):
    model_config = ConfigDict(extra="allow")

    task_name: TaskName
    task_path: TaskPath | None = Field(
        None,
        validate_default=True,
        description="Relative to DATASET_DIR (an absolute path inside it is accepted), or an uploaded task's "
        f"sha256:<hex> (POST /v1/tasks); defaults to task_name. Each component at most {MAX_PATH_PART_BYTES} bytes.",
    )
    instruction: Annotated[StrictStr, Field(max_length=MAX_TEXT_LENGTH, pattern=TEXT_PATTERN)] = ""

    @field_validator("task_path")
    @classmethod
    def _task_folder(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The task's folder inside DATASET_DIR (a task folder of either format), relative to it."""
        path = info.data.get("task_name") if value is None else value
        if path is None:  # task_name was refused: that error is the one answered
            return None
        if uploaded_tasks.is_uploaded(path):  # whether the pool holds it: Engine.require_task
            return _resolve(path, uploaded_tasks.checked_task_path)
        root = _settings(info).dataset_dir
        task_dir = _resolve(path, lambda p: resolve_task_path(root, p))
        if not _resolve(task_dir, is_task_dir):  # an OSError refused as a path's
            raise refuse(f": no task.yaml in {path!r} under DATASET_DIR (nor task.toml and instruction.md)")
        return str(task_dir.relative_to(root))


class RunCtx(BaseModel):
    model_config = ConfigDict(extra="allow")

    uid: RunCtxId = None
    group_index: RunCtxId = None
    sample_index: RunCtxId = None
    log_dir: LogDir | None = Field(
        None,
        validate_default=True,
        description="Inside TBENCH_OUTPUT_ROOT (relative to it, or absolute); empty or null: the default. "
        f"Each component at most {MAX_PATH_PART_BYTES} bytes.",
    )

    @field_validator("log_dir")
    @classmethod
    def _inside_output_root(cls, value: str | None, info: ValidationInfo) -> str:
        cfg = _settings(info)
        if not value:
            return str(cfg.default_log_dir)
        return str(_resolve(value, lambda p: resolve_log_dir(cfg.output_root, p)))


TIMEOUT_KEYS = ("ensure_image", "reset_session", "close_session", "eval")


class TaskTimeouts(BaseModel):
    """Seconds per step, overriding the settings. Not an object, other keys, and values that are not
    positive numbers are ignored."""

    model_config = ConfigDict(json_schema_extra=lambda schema, _: _untyped(schema))

    ensure_image: Seconds = None
    reset_session: Seconds = None
    close_session: Seconds = None
    eval: Seconds = None

    @model_validator(mode="before")
    @classmethod
    def _positive_numbers(cls, value) -> dict:
        if not isinstance(value, dict):
            return {}
        return {key: seconds for key in TIMEOUT_KEYS if (seconds := _seconds(value.get(key))) is not None}

    def given(self) -> dict:
        return self.model_dump(exclude_none=True)


def _untyped(schema: dict) -> None:
    del schema["type"]  # any JSON value is taken


def _seconds(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an integer beyond any float
        return None
    return seconds if 0 < seconds < float("inf") else None


class ToolCall(BaseModel):
    name: ToolName
    arguments: dict[str, Any] | None = Field(
        None,
        validate_default=True,
        description="Absent or null counts as {}. Arguments the tool cannot take give a [TOOL_ERROR] "
        "observation, not an HTTP error.",
    )

    @field_validator("arguments")
    @classmethod
    def _empty(cls, value: dict | None) -> dict:
        return value or {}


class _Body(BaseModel):
    """A request body (its fields in the order they are checked: the first error is answered)."""

    @model_validator(mode="before")
    @classmethod
    def _objects_absent(cls, value):
        """An absent task_meta or tool_call is answered like a null one: "task_meta must be a dict"."""
        if not isinstance(value, dict):
            return value
        absent = [name for name in ("task_meta", "tool_call") if name in cls.model_fields and name not in value]
        return {**value, **dict.fromkeys(absent)}


RunCtxField = Annotated[RunCtx | None, BeforeValidator(lambda value: {} if value is None else value)]


PriorityClass = Literal[priorities.CLASSES]
Priority = Annotated[
    PriorityClass | None,
    Field(
        description="The run's priority class: its jobs are taken before waiting jobs of lower classes "
        "(highest first: " + ", ".join(priorities.CLASSES) + "). Default: the tenant's (the operator's: "
        f"{priorities.DEFAULT}); a tenant's run may ask for its own or a lower one (PRIORITY_NOT_ALLOWED)."
    ),
]


class AllocateRequest(_Body):
    task_key: Id
    request_id: ScalarId = None
    priority: Priority = None


class LeaseRequest(_Body):
    lease_id: LeaseId


class ResetRequest(_Body):
    lease_id: LeaseId
    task_meta: TaskMeta
    run_ctx: RunCtxField = Field(None, validate_default=True)
    task_timeouts: TaskTimeouts = Field(default_factory=TaskTimeouts)


MAX_FORK = 64  # children of one fork request at most; capacity usually says no sooner
ForkCount = Annotated[
    StrictInt,
    Field(ge=1, le=MAX_FORK, description="How many children (runs) to make."),
    BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v),  # JSON's 2.0 is 2
]


class ForkRequest(_Body):
    count: ForkCount


class PoolForkRequest(_Body):
    lease_id: LeaseId
    count: ForkCount


class ExecToolRequest(_Body):
    lease_id: LeaseId
    tool_call: ToolCall


def _script_size(calls: list[ToolCall] | None) -> list[ToolCall] | None:
    if calls and len(json.dumps([call.model_dump() for call in calls])) > MAX_SCRIPT_BYTES:
        raise refuse(f"is larger than {MAX_SCRIPT_BYTES} bytes of JSON")
    return calls


class RunRequest(_Body):
    task_meta: TaskMeta
    run_ctx: RunCtxField = Field(None, validate_default=True)
    task_timeouts: TaskTimeouts = Field(default_factory=TaskTimeouts)
    script: Annotated[
        Annotated[list[ToolCall], Field(max_length=MAX_SCRIPT_STEPS)] | None,
        AfterValidator(_script_size),
        Field(
            description="Tool calls run after the start, in order, each as its own job; at most "
            f"{MAX_SCRIPT_BYTES} bytes of JSON."
        ),
    ] = None
    evaluate: Flag = Field(False, description="Run the tests after the script.")
    close: Flag = Field(False, description="Close the run at the end, or on a failure.")
    task_key: ScalarId = Field(None, description="Capacity key; defaults to task_meta.task_name.")
    request_id: ScalarId = Field(None, description="Same task_key and request_id within 300 s: same run.")
    priority: Priority = None

    def capacity_key(self) -> str:
        return text_id(self.task_key) or self.task_meta.task_name


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


class _Out(BaseModel):
    """A reply body: every field is in the reply, defaults too (so the schema requires them)."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class Error(_Out):
    ok: Literal[False] = False
    error: str
    code: Code
    retryable: Retryable


class Reply(_Out):
    """A successful reply; app/http.py's `ok` puts `"ok": true` first."""

    ok: Literal[True] = True


class PoolStatus(_Out):
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


class EpisodeJobs(_Out):
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


class Run(_Out):
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


class Job(_Out):
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
