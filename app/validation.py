"""Request validation shared by both HTTP faces: every rejection is a BadRequest with a reason.

The limits below are the one place the input constraints are written down: app/openapi.py
declares them in /openapi.json from these same constants.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from flask import request

from termpool.config import Settings
from termpool.paths import PathError, resolve_log_dir, resolve_task_path
from termpool.task_spec import MAX_TASK_NAME_LENGTH, TASK_NAME_PATTERN, valid_task_name  # noqa: F401 (see below)

MAX_BODY_BYTES = 8 << 20  # Flask's MAX_CONTENT_LENGTH: a larger body is answered 413
MAX_JSON_DEPTH = 64  # arrays and objects nested in a body, the body itself counting as 1
MAX_ID_LENGTH = 256  # task_key, request_id, lease_id, tool names
MAX_UID_LENGTH = 128  # run_ctx.uid, group_index, sample_index: uid is part of the run's log folder name
MAX_PATH_LENGTH = 1024  # task_path, log_dir
MAX_PATH_PART_BYTES = 255  # one component of a path (the file systems' NAME_MAX)
MAX_TEXT_LENGTH = 1 << 20  # task_meta.instruction
MIN_INTEGER, MAX_INTEGER = -(2**63), 2**63 - 1  # ids given as integers
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"  # C0, DEL and C1: NUL, tab, newline, ESC, ...
PRINTABLE_PATTERN = f"^[^{CONTROL_CHARACTERS}]*$"
TEXT_PATTERN = r"^[^\x00]*$"  # free text: newlines and tabs are fine, NUL is not
RUN_ID_PATTERN = r"^run-[0-9a-f]{16}$"
JOB_ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
TIMEOUT_KEYS = ("ensure_image", "reset_session", "close_session", "eval")
# MAX_TASK_NAME_LENGTH and TASK_NAME_PATTERN (Docker's naming rules, termpool/task_spec.py) are
# imported here so that app/openapi.py finds every limit in this module.

_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class BadRequest(ValueError):
    """Client error: answered 400 with this message."""


# ---- the body --------------------------------------------------------------------------------
def json_body() -> dict:
    """The request's JSON object; anything else (no body, not JSON, a list) counts as {}.

    Refused with a 400 instead: a body that is not UTF-8, holds a lone surrogate or a number
    that is not finite, or nests deeper than MAX_JSON_DEPTH. The parser's own recursion
    limit is caught, so a deeper body never reaches code that recurses.
    """
    raw = request.get_data(cache=True)  # over MAX_CONTENT_LENGTH: werkzeug raises the 413
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except BadRequest:
        raise
    except ValueError:
        return {}
    check_json_tree(body)
    return body if isinstance(body, dict) else {}


def _fits_double(number: int | float) -> bool:
    """False for 1e400 (parsed as inf) and for integers beyond any float, like 10**400."""
    try:
        return math.isfinite(float(number))
    except OverflowError:
        return False


def _no_constant(name: str):
    raise BadRequest(f"{name} is not a JSON number")


def check_json_tree(value) -> None:
    """Depth, valid Unicode and numbers that fit a double everywhere in a parsed body, without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise BadRequest("the request body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            if not _fits_double(item):
                raise BadRequest("the request body holds a number too large for a 64-bit float")
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            children = item if isinstance(item, list) else [*item.keys(), *item.values()]
            stack.extend((child, depth + 1) for child in children)


# ---- fields ----------------------------------------------------------------------------------
def _printable(value: str, field: str, max_length: int) -> str:
    if len(value) > max_length:
        raise BadRequest(f"{field} is longer than {max_length} characters")
    if _CONTROL.search(value):
        raise BadRequest(f"{field} must not contain control characters")
    return value


def required_str(body: dict, field: str) -> str:
    """A required id (task_key, lease_id): a non-empty printable string."""
    value = body.get(field)
    if value is None or value == "":
        raise BadRequest(f"{field} is required")
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string")
    return _printable(value, field, MAX_ID_LENGTH)


def scalar_id(obj: dict, key: str, field: str, max_length: int = MAX_ID_LENGTH) -> str:
    """An optional id that may be a string or an integer (request_id, run_ctx.uid); "" if absent."""
    value = obj.get(key)
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():  # JSON Schema's integers include 7.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRequest(f"{field} must be a string or an integer")
    if isinstance(value, int):
        if not MIN_INTEGER <= value <= MAX_INTEGER:
            raise BadRequest(f"{field} must be an integer of at most 64 bits")
        return str(value)
    return _printable(value, field, max_length)


def optional_str(body: dict, field: str) -> str:
    return scalar_id(body, field, field)


def _path(field: str, value, resolve: Callable[[str], Path]) -> Path:
    """A path field resolved inside its root; too long, control characters or outside: 400."""
    if isinstance(value, str):
        if len(value) > MAX_PATH_LENGTH:
            raise BadRequest(f"{field} is longer than {MAX_PATH_LENGTH} characters")
        if _CONTROL.search(value):
            raise BadRequest(f"{field} must not contain control characters")
        if any(len(part.encode()) > MAX_PATH_PART_BYTES for part in value.split("/")):
            raise BadRequest(f"{field} has a component longer than {MAX_PATH_PART_BYTES} bytes")
    try:
        return resolve(value)
    except PathError as exc:
        raise BadRequest(f"{field}: {exc}") from None
    except OSError as exc:
        raise BadRequest(f"{field}: {exc.strerror or exc}") from None


def task_meta(body: dict, cfg: Settings) -> dict:
    meta = body.get("task_meta")
    if not isinstance(meta, dict):
        raise BadRequest("task_meta must be a dict")
    name = meta.get("task_name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("task_meta.task_name is required")
    if not valid_task_name(name):
        raise BadRequest(
            f"task_meta.task_name must be letters and digits joined by '-', '.' or '_', at most "
            f"{MAX_TASK_NAME_LENGTH} characters: it names the task's Docker images and containers"
        )
    path = meta.get("task_path", name)
    task_dir = _path("task_meta.task_path", path, lambda p: resolve_task_path(cfg.dataset_dir, p))
    try:
        has_task = (task_dir / "task.yaml").is_file()
    except OSError as exc:
        raise BadRequest(f"task_meta.task_path: {exc.strerror or exc}") from None
    if not has_task:
        raise BadRequest(f"task_meta.task_path: no task.yaml in {path!r} under DATASET_DIR")
    instruction = meta.get("instruction", "")
    if not isinstance(instruction, str):
        raise BadRequest("task_meta.instruction must be a string")
    if len(instruction) > MAX_TEXT_LENGTH:
        raise BadRequest(f"task_meta.instruction is longer than {MAX_TEXT_LENGTH} characters")
    if "\x00" in instruction:
        raise BadRequest("task_meta.instruction must not contain a NUL character")
    return {
        **meta,
        "task_name": name,
        "task_path": str(task_dir.relative_to(cfg.dataset_dir)),
        "instruction": instruction,
    }


def run_ctx(body: dict, cfg: Settings) -> dict:
    ctx = body.get("run_ctx")
    if ctx is None:
        ctx = {}
    if not isinstance(ctx, dict):
        raise BadRequest("run_ctx must be a dict")
    for key in ("uid", "group_index", "sample_index"):
        scalar_id(ctx, key, f"run_ctx.{key}", MAX_UID_LENGTH)
    log_dir = ctx.get("log_dir")
    if log_dir in (None, ""):
        resolved: Path = cfg.default_log_dir
    else:
        resolved = _path("run_ctx.log_dir", log_dir, lambda p: resolve_log_dir(cfg.output_root, p))
    return {**ctx, "log_dir": str(resolved)}


def task_timeouts(body: dict) -> dict:
    """Keep only the positive, finite numbers; the spec says other values are ignored."""
    raw = body.get("task_timeouts")
    if not isinstance(raw, dict):
        return {}
    timeouts = {key: _seconds(value) for key, value in raw.items() if key in TIMEOUT_KEYS}
    return {key: value for key, value in timeouts.items() if value is not None}


def _seconds(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _fits_double(value):
        return None
    return float(value) if value > 0 else None


def tool_call(call) -> dict:
    """{name, arguments}; what the arguments hold is the tool's business (a TOOL_ERROR observation)."""
    if not isinstance(call, dict):
        raise BadRequest("tool_call must be a dict")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("tool_call.name must be a non-empty string")
    _printable(name, "tool_call.name", MAX_ID_LENGTH)
    arguments = call.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadRequest("tool_call.arguments must be a dict")
    return {"name": name, "arguments": arguments}
