"""The terminal tools (docs/tools.md), run in a task's client container.

Every tool call runs the tp-session helper (environments/helper/tp_session.c) once in the container:
through its server's unix socket when the caller names one (`ctl_socket`, a host path; a few
milliseconds), else, or when nobody answers there, as one `docker exec` (tens of milliseconds).
shell_write_content_to_file is one `tp-session put` through the server, or else (and for paths
the server declines) one put_archive. The sessions' processes and output live in
the container (/.termpool/sessions/<sid>/); the caller's `sessions` store keeps only what the
observations need between calls (kind, read offset, whether the end was reported):

    sessions.get(sid) -> dict (empty or None when unknown)
    sessions.set(sid, **fields)   # string values

so a session survives a restart of every worker process.

Modules: calls (run_tool), shell (the five tools), texts (observation texts), limits (output
limits, cap_text), terminal (output bytes to text), transport (socket or docker exec, archive
API), server_socket (the server's socket protocol and restarts), schemas (tool_schemas).
"""

from environments.tools.calls import run_tool
from environments.tools.limits import OutputLimits, cap_text
from environments.tools.schemas import KILL_SCHEMA, TOOL_SCHEMAS, tool_schemas

__all__ = ["KILL_SCHEMA", "TOOL_SCHEMAS", "OutputLimits", "cap_text", "run_tool", "tool_schemas"]
