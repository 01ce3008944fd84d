"""How record fields are stored in a Redis hash: strings, JSON for the structured ones."""

from __future__ import annotations

import json

# Stored as JSON (structured, or possibly null); every other field is a plain string, so a
# client's task_key of "null" or "true" stays that string.
JSON_FIELDS = (
    "task_meta",
    "run_ctx",
    "task_timeouts",
    "tool_schemas",
    "tests",
    "rewards",
    "env",
    "script",
    "result",
    "score",
    "retryable",
    "call",
    "children",
)
INT_FIELDS = ("attempts", "disk_limit")


def encode(fields: dict) -> dict:
    """A record's fields as the hash stores them."""
    out = {}
    for key, value in fields.items():
        if key in JSON_FIELDS:
            out[key] = json.dumps(value)
        else:
            out[key] = str(value)
    return out


def decode(raw: dict) -> dict:
    """A hash's fields as the record they store (JSON parsed, numbers and times typed)."""
    out = {}
    for key, value in raw.items():
        if key in JSON_FIELDS:
            try:
                out[key] = json.loads(value)
                continue
            except ValueError:
                pass
        out[key] = value
    for key in ("created_at", "last_used_at", "closed_at", "queued_at", "started_at", "finished_at"):
        if isinstance(out.get(key), str):
            try:
                out[key] = float(out[key])
            except ValueError:
                pass
    for key in INT_FIELDS:
        if isinstance(out.get(key), str) and out[key].isdigit():
            out[key] = int(out[key])
    return out
