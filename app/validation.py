"""Request validation shared by both HTTP faces: every rejection is a BadRequest with a reason."""
from __future__ import annotations

import math
from pathlib import Path

from flask import request

from termpool.config import Settings
from termpool.paths import PathError, resolve_log_dir, resolve_task_path

MAX_ID_LENGTH = 256


class BadRequest(ValueError):
    """Client error: answered 400 with this message."""


def json_body() -> dict:
    """The request's JSON object; anything else (no body, invalid JSON, a list) counts as {}."""
    body = request.get_json(silent=True, force=True)
    return body if isinstance(body, dict) else {}


def required_str(body: dict, field: str) -> str:
    value = body.get(field)
    if value is None or value == "":
        raise BadRequest(f"{field} is required")
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string")
    if len(value) > MAX_ID_LENGTH:
        raise BadRequest(f"{field} is longer than {MAX_ID_LENGTH} characters")
    return value


def optional_str(body: dict, field: str) -> str:
    value = body.get(field)
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRequest(f"{field} must be a string")
    value = str(value)
    if len(value) > MAX_ID_LENGTH:
        raise BadRequest(f"{field} is longer than {MAX_ID_LENGTH} characters")
    return value


def task_meta(body: dict, cfg: Settings) -> dict:
    meta = body.get("task_meta")
    if not isinstance(meta, dict):
        raise BadRequest("task_meta must be a dict")
    name = meta.get("task_name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("task_meta.task_name is required")
    path = meta.get("task_path", name)
    try:
        task_dir = resolve_task_path(cfg.dataset_dir, path)
    except PathError as exc:
        raise BadRequest(f"task_meta.task_path: {exc}") from None
    if not (task_dir / "task.yaml").is_file():
        raise BadRequest(f"task_meta.task_path: no task.yaml in {path!r} under DATASET_DIR")
    instruction = meta.get("instruction", "")
    if not isinstance(instruction, str):
        raise BadRequest("task_meta.instruction must be a string")
    return {**meta, "task_name": name, "task_path": str(task_dir.relative_to(cfg.dataset_dir)),
            "instruction": instruction}


def run_ctx(body: dict, cfg: Settings) -> dict:
    ctx = body.get("run_ctx")
    if ctx is None:
        ctx = {}
    if not isinstance(ctx, dict):
        raise BadRequest("run_ctx must be a dict")
    log_dir = ctx.get("log_dir")
    if log_dir in (None, ""):
        resolved: Path = cfg.default_log_dir
    else:
        try:
            resolved = resolve_log_dir(cfg.output_root, log_dir)
        except PathError as exc:
            raise BadRequest(f"run_ctx.log_dir: {exc}") from None
    return {**ctx, "log_dir": str(resolved)}


def task_timeouts(body: dict) -> dict:
    """Keep only the positive, finite numbers; the spec says other values are ignored."""
    raw = body.get("task_timeouts")
    if not isinstance(raw, dict):
        return {}
    return {k: float(v) for k, v in raw.items()
            if k in ("ensure_image", "reset_session", "close_session", "eval")
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def tool_call(call) -> dict:
    if not isinstance(call, dict):
        raise BadRequest("tool_call must be a dict")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("tool_call.name must be a non-empty string")
    arguments = call.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadRequest("tool_call.arguments must be a dict")
    return {"name": name, "arguments": arguments}
