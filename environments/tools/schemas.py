"""The tool schemas `reset` returns (docs/tools.md)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

# tool_schemas.json is a byte-for-byte copy of the tool schemas of camel-ai's TerminalToolkit
# (https://github.com/camel-ai/camel, Apache License 2.0); policies see them word for word.
SCHEMAS_FILE = Path(__file__).with_name("tool_schemas.json")
TOOL_SCHEMAS: list[dict] = json.loads(SCHEMAS_FILE.read_text(encoding="utf-8"))

# The opt-in fifth tool (docs/tools.md: the prompt mentions it; the reference does not expose it).
KILL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": "shell_kill_process",
        "description": "Terminates a running non-blocking process.",
        "strict": True,
        "parameters": {
            "properties": {
                "id": {"type": "string", "description": "The unique session ID of the process to terminate."},
            },
            "required": ["id"],
            "type": "object",
            "additionalProperties": False,
        },
    },
}


def tool_schemas(expose_kill: bool = False) -> list[dict]:
    """The schemas `reset` returns: the four of docs/tools.md, plus shell_kill_process when opted in."""
    schemas = copy.deepcopy(TOOL_SCHEMAS)
    if expose_kill:
        schemas.append(copy.deepcopy(KILL_SCHEMA))
    return schemas
