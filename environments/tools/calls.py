"""One tool call: the model's name and arguments in, the observation text out."""

from __future__ import annotations

from environments.session_helper import WORKSPACE
from environments.tools.limits import OutputLimits, cap_text
from environments.tools.shell import TOOLS, ToolContext, is_infrastructure_error, shell_kill_process
from environments.tools.texts import TOOL_FAILED, UNKNOWN_TOOL
from environments.tools.transport import HelperTransport


def run_tool(
    container,
    name,
    arguments,
    sessions,
    *,
    expose_kill: bool = False,
    ctl_socket: str | None = None,
    limits: OutputLimits | None = None,
    workdir: str = "",
) -> str:
    """Run one tool call in `container` and return the observation text.

    `arguments` are passed exactly as the model wrote them; errors become
    `[TOOL_ERROR] ...` observations (docs/tools.md / docs/http-api.md); connection failures to Docker or
    Redis propagate.

    `container` may be a `KnownContainer` (environments/docker_client.py): only its id, client
    and configured user are used. `ctl_socket` is the host path of the
    container's tp-session server socket (prepare_container(serve=True)); when nobody answers
    there, the call goes through `docker exec` and the server is restarted in the background.
    `limits` defaults to the settings' (SESSION_OUTPUT_LIMIT, OBSERVATION_LIMIT). `workdir` is
    where sessions start and relative paths lead (default /workspace, the reference's).
    """
    limits = limits or OutputLimits.from_settings()
    context = ToolContext(HelperTransport(container, ctl_socket), sessions, limits, workdir or WORKSPACE)
    return cap_text(_observe(context, name, arguments, expose_kill), limits.observation_chars)


def _observe(context: ToolContext, name, arguments, expose_kill: bool) -> str:
    tool = TOOLS.get(name) if isinstance(name, str) else None
    if tool is None or (tool is shell_kill_process and not expose_kill):
        return UNKNOWN_TOOL.format(name=name)
    try:
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be an object, not {type(arguments).__name__}")
        return tool(context, **arguments)
    except Exception as exc:
        if is_infrastructure_error(exc):
            raise
        return TOOL_FAILED.format(name=name, type=type(exc).__name__, error=exc)
