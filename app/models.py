"""Request bodies of both HTTP faces, declared once as pydantic models (replies: app/replies.py;
field types and limits: app/fields.py).

The routes validate every body with these models (app/http.py: `operation`) and
app/apidoc.py builds /openapi.json from the same models, so the checks and the document
cannot drift. A failed validation is answered 400 with one readable text made by
`fields.explain` from the first error.

Paths (task_meta.task_path, run_ctx.log_dir) are resolved while validating: the validation
context holds the settings (`{"cfg": Settings}`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.fields import (
    MAX_PATH_PART_BYTES,
    MAX_SCRIPT_BYTES,
    MAX_SCRIPT_STEPS,
    MAX_TEXT_LENGTH,
    TEXT_PATTERN,
    Flag,
    Id,
    LeaseId,
    LogDir,
    Priority,
    RunCtxId,
    ScalarId,
    Seconds,
    TaskName,
    TaskPath,
    ToolName,
    refuse,
    text_id,
)
from poolcore import uploaded_tasks
from poolcore.paths import PathError, resolve_log_dir, resolve_task_path
from poolcore.task_spec import is_task_dir


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


class RequestBody(BaseModel):
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


class AllocateRequest(RequestBody):
    task_key: Id
    request_id: ScalarId = None
    priority: Priority = None
    priority: Priority = None


class LeaseRequest(RequestBody):
    lease_id: LeaseId


class ResetRequest(RequestBody):
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


class ForkRequest(RequestBody):
    count: ForkCount


class PoolForkRequest(RequestBody):
    lease_id: LeaseId
    count: ForkCount


class ExecToolRequest(RequestBody):
    lease_id: LeaseId
    tool_call: ToolCall


def _script_size(calls: list[ToolCall] | None) -> list[ToolCall] | None:
    if calls and len(json.dumps([call.model_dump() for call in calls])) > MAX_SCRIPT_BYTES:
        raise refuse(f"is larger than {MAX_SCRIPT_BYTES} bytes of JSON")
    return calls


class RunRequest(RequestBody):
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
    priority: Priority = None

    def capacity_key(self) -> str:
        return text_id(self.task_key) or self.task_meta.task_name
