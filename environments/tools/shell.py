"""The five shell tools (docs/tools.md) and what they share per call."""

from __future__ import annotations

import math
import posixpath

import docker.errors
import redis.exceptions
import requests

from environments.session_helper import WORKSPACE, container_user, is_root, session_dir
from environments.tools.limits import OutputLimits, with_omitted
from environments.tools.terminal import clean, complete_len
from environments.tools.texts import (
    COMPLETED,
    EXISTS,
    IDLE,
    KILLED,
    NO_ACTIVE,
    NO_OUTPUT,
    NO_SESSION,
    NOT_RUNNING,
    SENT_NO_OUTPUT,
    STARTED,
    STILL_OUTPUTTING,
    STILL_RUNNING,
    TERMINATED,
    TERMINATED_NO_NEW,
    TIMED_OUT,
    WRITE_FAILED,
    WRITE_TERMINATED,
    WRITTEN,
)
from environments.tools.transport import HelperTransport
from poolcore.failures import ContainerLost

KIND_INTERACTIVE = "interactive"  # started with block false/null: pty, open stdin
KIND_BLOCKING = "blocking"  # a blocking command that outlived its timeout


def is_infrastructure_error(exc: BaseException) -> bool:
    """Docker or Redis unreachable, or the container gone: the caller's business (a 503), not
    an observation."""
    return isinstance(exc, (requests.exceptions.ConnectionError, redis.exceptions.RedisError, ContainerLost))


class ToolContext:
    """One call's container (through its helper), the run's sessions store, output limits and
    where its sessions start (relative file paths lead there too)."""

    def __init__(self, helper: HelperTransport, sessions, limits: OutputLimits, workdir: str = WORKSPACE):
        self.helper = helper
        self.sessions = sessions
        self.limits = limits
        self.workdir = workdir

    @property
    def spawn_limits(self) -> list[str]:
        return ["--limit", str(self.limits.session_bytes), "--max", str(self.limits.read_bytes)]

    @property
    def read_max(self) -> list[str]:
        return ["--max", str(self.limits.read_bytes)]

    def session(self, sid: str) -> dict:
        record = self.sessions.get(sid) or {}
        return {_text(k): _text(v) for k, v in record.items()}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _dropped(head: list[str], index: int) -> int:
    """The helper's count of output bytes it did not send (limits), from its header line."""
    return int(head[index]) if len(head) > index else 0


def _require_str(name: str, value) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")


# Each tool takes the context positionally and the model's arguments as keywords, so a missing
# or unexpected argument raises the usual TypeError, e.g. "shell_view() missing 1 required
# positional argument: 'id'".


def shell_exec(ctx: ToolContext, /, id, command, block=True, timeout=20.0) -> str:
    _require_str("id", id)
    _require_str("command", command)
    if block is not None and not isinstance(block, bool):
        raise TypeError(f"block must be a boolean or null, not {type(block).__name__}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise TypeError(f"timeout must be a number or null, not {type(timeout).__name__}")
    if timeout is not None and math.isnan(timeout):
        raise ValueError("timeout must be a number, not NaN")
    sdir = session_dir(id)
    if block:
        wait = "-1" if timeout is None or timeout == math.inf else repr(max(float(timeout), 0.0))
        head, body = ctx.helper.call(
            ["spawn", sdir, "0", wait, *ctx.spawn_limits, "--", "bash", "-c", command], workdir=ctx.workdir
        )
        if head[0] == "done":
            text = with_omitted(clean(body), _dropped(head, 2))
            return text if text.strip() else NO_OUTPUT
        if head[0] == "timeout":
            ctx.sessions.set(id, kind=KIND_BLOCKING, offset="0", done="0")
            return TIMED_OUT.format(timeout=timeout, id=id)
    else:
        head, _ = ctx.helper.call(
            ["spawn", sdir, "1", "-", *ctx.spawn_limits, "--", "bash", "-c", command],
            workdir=ctx.workdir,
            environment={"PYTHONUNBUFFERED": "1"},
        )
        if head[0] == "exists":
            return EXISTS.format(id=id)
        if head[0] == "started":
            ctx.sessions.set(id, kind=KIND_INTERACTIVE, offset="0", done="0")
            return STARTED.format(id=id)
    raise RuntimeError(f"unexpected reply from tp-session spawn: {' '.join(head)}")


def shell_view(ctx: ToolContext, /, id) -> str:
    _require_str("id", id)
    record = ctx.session(id)
    if not record:
        return NO_SESSION.format(id=id)
    offset = int(record.get("offset") or 0)
    if record.get("kind") == KIND_BLOCKING:
        if record.get("done") == "1":
            return TERMINATED_NO_NEW
        head, body = ctx.helper.call(["read", session_dir(id), "0", "--if-exited", *ctx.read_max])
        if head[0] == "missing":
            return NO_SESSION.format(id=id)
        if head[0] == "running":
            return STILL_RUNNING
        ctx.sessions.set(id, done="1", offset=head[1])
        return with_omitted(clean(body), _dropped(head, 3)) + COMPLETED
    head, body = ctx.helper.call(["read", session_dir(id), str(offset), *ctx.read_max])
    if head[0] == "missing":
        return NO_SESSION.format(id=id)
    exited, dropped = head[0] == "exited", _dropped(head, 3)
    used = len(body) if exited else complete_len(body)
    if used or dropped:
        ctx.sessions.set(id, offset=str(offset + dropped + used))
    text = with_omitted(clean(body[:used], pty=True), dropped)
    if exited:
        return text + TERMINATED if text else TERMINATED_NO_NEW
    return text if text else IDLE


def shell_write_to_process(ctx: ToolContext, /, id, command) -> str:
    _require_str("id", id)
    _require_str("command", command)
    record = ctx.session(id)
    if record.get("kind") != KIND_INTERACTIVE:
        return NO_ACTIVE.format(id=id)
    head, body = ctx.helper.call(["write", session_dir(id), command, *ctx.read_max])
    if head[0] not in ("running", "exited"):
        return NO_ACTIVE.format(id=id)
    exited, start, capped, dropped = head[0] == "exited", int(head[1]), head[3] == "1", _dropped(head, 4)
    used = len(body) if exited else complete_len(body)
    ctx.sessions.set(id, offset=str(start + dropped + used))
    text = with_omitted(clean(body[:used], pty=True), dropped)
    if exited:
        return text + WRITE_TERMINATED
    if capped:
        return text + STILL_OUTPUTTING
    return text if text.strip() else SENT_NO_OUTPUT.format(id=id)


def shell_kill_process(ctx: ToolContext, /, id) -> str:
    _require_str("id", id)
    if not ctx.session(id):
        return NO_SESSION.format(id=id)
    head, _ = ctx.helper.call(["kill", session_dir(id)])
    return KILLED.format(id=id) if head[0] == "killed" else NOT_RUNNING.format(id=id)


def shell_write_content_to_file(ctx: ToolContext, /, content, file_path) -> str:
    _require_str("content", content)
    _require_str("file_path", file_path)
    try:
        _write_file(ctx.helper, content, file_path, ctx.workdir)
    except Exception as exc:
        if is_infrastructure_error(exc):
            raise
        reason = exc.explanation if isinstance(exc, docker.errors.APIError) else None
        return WRITE_FAILED.format(path=file_path, reason=reason or str(exc) or type(exc).__name__)
    return WRITTEN.format(path=file_path)


def _write_file(helper: HelperTransport, content: str, file_path: str, workdir: str) -> None:
    data = content.encode("utf-8")
    path = posixpath.normpath(posixpath.join(workdir, file_path))
    path = "/" + path.lstrip("/")
    if path == "/" or file_path.endswith("/"):
        raise IsADirectoryError(f"Is a directory: '{path}'")
    root = is_root(container_user(helper.container))
    # Through the server: as the container's user, no put_archive. Where that cannot be done
    # the plain way ("denied": no permission, a special file or filesystem), or for root
    # when the parents cannot be made in place, put_archive below does it as before.
    served = helper.put_file(path, data)
    if served is not None:
        status, reason = served
        if status == "ok":
            return
        if status == "error" and not root:
            raise OSError(reason)
    # put_archive would replace a directory at `path` by the file, contents and all: refuse.
    uid = gid = 0
    if root:
        # put_archive creates missing parents (as root); a HEAD request stats the target.
        if helper.is_directory(path):
            raise IsADirectoryError(f"Is a directory: '{path}'")
    else:
        # Create missing parents as the container's user (so they are theirs), check the
        # target, and learn the numeric ids the archive's file must carry.
        out, err, _ = helper.run(["mkparents", path])
        ids = out.split()
        if len(ids) != 2 or not all(i.isdigit() for i in ids):
            raise OSError((err or out).decode("utf-8", "replace").strip())
        uid, gid = int(ids[0]), int(ids[1])
    helper.put_archive_file(path, data, uid, gid)


TOOLS = {
    f.__name__: f
    for f in (shell_exec, shell_view, shell_write_to_process, shell_write_content_to_file, shell_kill_process)
}
