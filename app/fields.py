"""What the request and reply models (app/models.py, app/replies.py and the routes' own model
modules) are built from: the limits of a body, the texts of a refused field (`refuse`, and
`explain` for a failed validation: "task_meta.task_path is longer than 1024 characters"), and
the field types (ids, task names and paths, tool names, seconds)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from poolcore import priorities
from poolcore.task_spec import MAX_TASK_NAME_LENGTH, TASK_NAME_PATTERN

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


PriorityClass = Literal[priorities.CLASSES]
Priority = Annotated[
    PriorityClass | None,
    Field(
        description="The run's priority class: its jobs are taken before waiting jobs of lower classes "
        "(highest first: " + ", ".join(priorities.CLASSES) + "). Default: the tenant's (the operator's: "
        f"{priorities.DEFAULT}); a tenant's run may ask for its own or a lower one (PRIORITY_NOT_ALLOWED)."
    ),
]
