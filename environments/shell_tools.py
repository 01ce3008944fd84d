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
"""

from __future__ import annotations

import base64
import copy
import io
import json
import logging
import math
import os
import posixpath
import re
import socket
import struct
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import requests

from environments.session_helper import (
    HELPER_PATH,
    WORKSPACE,
    container_user,
    is_root,
    prepare_container,
    session_dir,
    start_server,
)
from termpool.config import settings

log = logging.getLogger(__name__)

# tool_schemas.json is a byte-for-byte copy of the tool schemas of camel-ai's TerminalToolkit
# (https://github.com/camel-ai/camel, Apache License 2.0); policies see them word for word.
_SCHEMAS_FILE = Path(__file__).with_name("tool_schemas.json")
TOOL_SCHEMAS: list[dict] = json.loads(_SCHEMAS_FILE.read_text(encoding="utf-8"))

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


# ---- observation texts (docs/tools.md; the policy learned to read them, keep them exact) ----------
NO_OUTPUT = "Command executed successfully (no output)."
STARTED = (
    "Session '{id}' started.\n\nYou could use:\n  - shell_view('{id}') - get output\n"
    "  - shell_write_to_process('{id}', '<input>') - send input\n  - shell_kill_process('{id}') - terminate"
)
EXISTS = "Error: Session '{id}' already exists and is running. Use a different ID or kill the existing session first."
TIMED_OUT = (
    "Command did not complete within {timeout} seconds. Process continues in background as session "
    "'{id}'.\n\nYou can use:\n  - shell_view('{id}') - get output\n  - shell_kill_process('{id}') - terminate"
)
NO_SESSION = "Error: No session found with ID '{id}'."
IDLE = (
    "[No new output]\nSession is running but idle. Actions could take:\n"
    "  - For interactive sessions: Send input with shell_write_to_process()\n"
    "  - For long tasks: Check again later (don't poll too frequently)"
)
TERMINATED = "\n\n--- SESSION TERMINATED ---"
TERMINATED_NO_NEW = "--- SESSION TERMINATED (no new output) ---"
STILL_RUNNING = (
    "[Process still running]\nCommand is executing in background. Check again later for output.\n"
    "Use shell_kill_process() to terminate if needed."
)
COMPLETED = "\n\n--- SESSION COMPLETED ---"
NO_ACTIVE = "Error: No active non-blocking session found with ID '{id}'."
SENT_NO_OUTPUT = "Input sent to session '{id}' successfully (no output)."
STILL_OUTPUTTING = (
    "\n--- WARNING: Process is still actively outputting after max wait time. "
    "Consider waiting before sending the next command. ---"
)
WRITE_TERMINATED = "\n--- SESSION TERMINATED ---"
WRITTEN = "Content successfully written to '{path}' in Docker container."
WRITE_FAILED = "Error writing to file '{path}' in Docker container: {reason}"
KILLED = "Process in session '{id}' has been terminated."
NOT_RUNNING = "Session '{id}' is not running."

# Added where output was cut (OutputLimits); the texts above are otherwise never changed.
OMITTED = "[... {count} earlier {unit} of output not shown (output limit) ...]\n"

KIND_INTERACTIVE = "interactive"  # started with block false/null: pty, open stdin
KIND_BLOCKING = "blocking"  # a blocking command that outlived its timeout


def _is_infrastructure_error(exc: BaseException) -> bool:
    """Docker or Redis unreachable: the caller's business (a 503), not an observation."""
    if isinstance(exc, requests.exceptions.ConnectionError):
        return True
    module = type(exc).__module__ or ""
    return module == "redis" or module.startswith("redis.")


@dataclass(frozen=True)
class OutputLimits:
    """How much output a session keeps on disk (bytes; the oldest is dropped beyond it) and
    how long one observation may be (characters; the newest part is kept)."""

    session_bytes: int
    observation_chars: int

    @classmethod
    def from_settings(cls) -> OutputLimits:
        cfg = settings()
        return cls(cfg.session_output_limit, cfg.observation_limit)

    @property
    def read_bytes(self) -> int:
        """The most output bytes one observation asks the helper for: with its note and status
        text the observation then stays within observation_chars (a byte is at most a character)."""
        return max(self.observation_chars - _NOTE_RESERVE, 1)


_NOTE_RESERVE = 512  # longer than the omitted-output note plus any status text after the output


def cap_text(text: str, limit: int) -> str:
    """text, or its newest part behind an OMITTED note, in at most `limit` characters."""
    if limit <= 0 or len(text) <= limit:
        return text
    keep = max(limit - _NOTE_RESERVE, 0)
    return OMITTED.format(count=len(text) - keep, unit="characters") + text[len(text) - keep :]


def _with_omitted(text: str, dropped: int) -> str:
    return OMITTED.format(count=dropped, unit="bytes") + text if dropped > 0 else text


def run_tool(
    container,
    name,
    arguments,
    sessions,
    *,
    expose_kill: bool = False,
    ctl_socket: str | None = None,
    limits: OutputLimits | None = None,
) -> str:
    """Run one tool call in `container` and return the observation text.

    `arguments` are passed exactly as the model wrote them; errors become
    `[TOOL_ERROR] ...` observations (docs/tools.md / docs/http-api.md); connection failures to Docker or
    Redis propagate.

    `container` may be a bare model (`containers.prepare_model({"Id": ..., "Config": {"User":
    ...}})`): only its id, client and Config.User are used. `ctl_socket` is the host path of the
    container's tp-session server socket (prepare_container(serve=True)); when nobody answers
    there, the call goes through `docker exec` and the server is restarted in the background.
    `limits` defaults to the settings' (SESSION_OUTPUT_LIMIT, OBSERVATION_LIMIT).
    """
    limits = limits or OutputLimits.from_settings()
    return cap_text(
        _run_tool(container, name, arguments, sessions, expose_kill, ctl_socket, limits), limits.observation_chars
    )


def _run_tool(container, name, arguments, sessions, expose_kill, ctl_socket, limits) -> str:
    tool = _TOOLS.get(name) if isinstance(name, str) else None
    if tool is None or (tool is shell_kill_process and not expose_kill):
        return f"[TOOL_ERROR] unknown tool: {name}"
    try:
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be an object, not {type(arguments).__name__}")
        return tool(_Context(container, sessions, ctl_socket, limits), **arguments)
    except Exception as exc:
        if _is_infrastructure_error(exc):
            raise
        return f"[TOOL_ERROR] {name}: {type(exc).__name__}: {exc}"


# ---- plumbing -----------------------------------------------------------------------------
class _Context:
    def __init__(self, container, sessions, ctl_socket: str | None, limits: OutputLimits):
        self.container = container
        self.sessions = sessions
        self.ctl_socket = ctl_socket
        self.limits = limits

    @property
    def spawn_limits(self) -> list[str]:
        return ["--limit", str(self.limits.session_bytes), "--max", str(self.limits.read_bytes)]

    @property
    def read_max(self) -> list[str]:
        return ["--max", str(self.limits.read_bytes)]

    def session(self, sid: str) -> dict:
        record = self.sessions.get(sid) or {}
        return {_text(k): _text(v) for k, v in record.items()}

    def _exec(self, argv, workdir, environment) -> tuple[bytes, bytes]:
        # The low-level API: exec_create + exec_start is one round trip fewer than exec_run
        # (which also inspects the exit code we do not need).
        api = self.container.client.api
        exec_id = api.exec_create(
            self.container.id, argv, stdout=True, stderr=True, workdir=workdir, environment=environment
        )["Id"]
        out, err = api.exec_start(exec_id, demux=True)
        return out or b"", err or b""

    def is_directory(self, path: str) -> bool:
        """Stat a path through the archive API's HEAD request: no process is started."""
        api = self.container.client.api
        res = api.head(api._url("/containers/{0}/archive", self.container.id), params={"path": path})
        if res.status_code != 200:  # missing, or a parent is not a directory: put_archive says why
            return False
        stat = json.loads(base64.b64decode(res.headers.get("X-Docker-Container-Path-Stat") or "e30="))
        return bool(int(stat.get("mode", 0)) & (1 << 31))  # Go's os.ModeDir

    def put_file(self, path: str, data: bytes) -> tuple[str, str] | None:
        """Write a file through the server (`tp-session put`): (status, reason); None when there
        is no server to ask (it is restarted in the background)."""
        if not self.ctl_socket:
            return None
        out = _ask_server(self.ctl_socket, _request(["put", path], None, None), data)
        if out is None:
            _restart_server(self.container, self.ctl_socket)
            return None
        status, _, reason = out.decode("utf-8", "replace").partition("\n")[0].partition(" ")
        return status, reason

    def run_helper(
        self, args: list[str], workdir: str | None = None, environment: dict | None = None
    ) -> tuple[bytes, bytes]:
        """Run tp-session in the container; its stdout and stderr (both in the first through
        the server, which merges them)."""
        if self.ctl_socket:
            request = _request(args, workdir, environment)
            out = _ask_server(self.ctl_socket, request)
            if out is not None and _unprepared(out):
                prepare_container(self.container)  # /workspace or the helper was removed
                out = _ask_server(self.ctl_socket, request)
            if out is not None:
                return out, b""
            try:
                return self._run_helper_exec(args, workdir, environment)
            finally:
                _restart_server(self.container, self.ctl_socket)
        return self._run_helper_exec(args, workdir, environment)

    def _run_helper_exec(self, args, workdir, environment) -> tuple[bytes, bytes]:
        argv = [HELPER_PATH, *args]
        out, err = self._exec(argv, workdir, environment)
        if out.startswith(b"OCI runtime exec failed") and (b"tp-session" in out or WORKSPACE.encode() in out):
            prepare_container(self.container)  # a container nobody prepared: do it now, once
            out, err = self._exec(argv, workdir, environment)
        return out, err

    def helper(
        self, args: list[str], *, workdir: str | None = None, environment: dict | None = None
    ) -> tuple[list[str], bytes]:
        """Run tp-session; returns its header line's fields and the raw bytes after it."""
        out, err = self.run_helper(args, workdir, environment)
        if (err or out).startswith(_OLD_SPAWN_USAGE):
            # A helper from before the output limits (a container that outlived an upgrade of
            # the workers): install the current one, whose arguments these are, and retry.
            prepare_container(self.container)
            out, err = self.run_helper(args, workdir, environment)
        head, newline, body = out.partition(b"\n")
        if not newline or not head or out.startswith((b"OCI runtime", b"tp-session: ")):
            detail = (err or out).decode("utf-8", "replace").strip(". \n")
            raise RuntimeError(f"tp-session {args[0]} failed: {detail or 'no output'}")
        return head.decode("ascii", "replace").split(), body


_OLD_SPAWN_USAGE = b"tp-session: usage: spawn DIR PTY(0|1) WAIT(-|seconds) -- argv..."


# ---- the server's socket (protocol: cmd_serve in tp_session.c) ---------------------------
_CONNECT_TIMEOUT = 2.0  # a live server accepts at once (the kernel queues the connection)
_REPLY_MAX = 64 << 20  # beyond this the reply is cut (the helper stops at the closed socket)
_RESTART_EVERY = 5.0  # seconds between restarts of one socket's server


def _wire(text: str) -> bytes:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: U+FFFD, what docker's JSON decoding makes of them
        data = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
    if b"\0" in data:
        raise ValueError("embedded null byte")
    return data


def _request(args, workdir, environment) -> bytes:
    fields = [workdir or "", *(f"{k}={v}" for k, v in (environment or {}).items()), "", *args]
    payload = b"".join(_wire(f) + b"\0" for f in fields)
    return b"TPS1" + struct.pack(">I", len(payload)) + payload


def _connect(sock: socket.socket, path: str) -> None:
    if len(os.fsencode(path)) < 100:
        sock.connect(path)
        return
    # Longer than sun_path holds: reach it through an O_PATH descriptor of its directory.
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def _ask_server(path: str, request: bytes, stdin: bytes = b"") -> bytes | None:
    """The helper's reply through the server at `path`; None when the request certainly never
    ran (no socket, no server, or a reset before any reply: the kernel dropped the connection
    with the request unread), so the caller may send it another way. A reply that is simply
    empty (the helper was killed after it took the request) is returned as such, never retried."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_CONNECT_TIMEOUT)
        try:
            _connect(sock, path)
            # No read timeout: a blocking command may run `timeout` seconds, or without limit.
            sock.settimeout(None)
            sock.sendall(request + stdin)
            sock.shutdown(socket.SHUT_WR)  # end of the helper's stdin
        except OSError:
            return None
        reply = bytearray()
        while len(reply) < _REPLY_MAX:
            try:
                chunk = sock.recv(min(1 << 20, _REPLY_MAX - len(reply)))
            except ConnectionResetError:
                if not reply:
                    return None
                break  # a refusal that left part of the request unread: its message came first
            if not chunk:
                break
            reply += chunk
        return bytes(reply)
    finally:
        sock.close()


def _unprepared(out: bytes) -> bool:
    """The server could not run the request because /workspace or the helper is gone."""
    return (
        out.startswith((b"tp-session: chdir ", b"tp-session: cannot run the helper "))
        and b"No such file or directory" in out.split(b"\n", 1)[0]
    )


_restart_lock = threading.Lock()
_restarts: dict[str, float] = {}


def _restart_server(container, path: str) -> None:
    """(Re)start the container's server in a background thread, at most every few seconds per
    socket: the call that found it gone has already been served by docker exec."""
    now = time.monotonic()
    with _restart_lock:
        if now - _restarts.get(path, -math.inf) < _RESTART_EVERY:
            return
        if len(_restarts) > 1000:  # one entry per socket ever restarted: forget the old ones
            for key in [k for k, t in _restarts.items() if now - t >= _RESTART_EVERY]:
                del _restarts[key]
        _restarts[path] = now

    def restart():
        try:
            try:
                start_server(container)
            except RuntimeError as exc:
                if not str(exc).startswith("OCI runtime exec failed"):
                    raise
                prepare_container(container, serve=True)  # the helper is missing: install it too
        except Exception as exc:
            log.warning("restarting tp-session serve for %s failed: %s", path, exc)

    threading.Thread(target=restart, name="tp-serve-restart", daemon=True).start()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _dropped(head: list[str], index: int) -> int:
    """The helper's count of output bytes it did not send (limits), from its header line."""
    return int(head[index]) if len(head) > index else 0


def _require_str(name: str, value) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")


_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[()*+][0-~]|[@-_=>78])")
_ESC_PREFIX = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*|[()*+])?\Z")


def _clean(data: bytes, pty: bool = False) -> str:
    """Decode as UTF-8 dropping invalid bytes and remove ANSI escape sequences. A pty turns
    every newline into CRLF; that CR is the terminal's, not the program's, so it goes too."""
    text = _ANSI.sub("", data.decode("utf-8", errors="ignore"))
    return text.replace("\r\n", "\n") if pty else text


def _complete_len(data: bytes) -> int:
    """How much of the output of a still-running process can be shown now: a multi-byte
    character, an escape sequence or a CRLF cut at the end waits for its remaining bytes (the
    stored offset is not advanced past it)."""
    cut = len(data)
    for i in range(cut - 1, max(cut - 4, -1), -1):
        byte = data[i]
        if byte & 0xC0 == 0x80:  # continuation byte: look further back for the lead byte
            continue
        need = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
        if cut - i < need:
            cut = i
        break
    esc = data.rfind(b"\x1b", max(0, cut - 256), cut)
    if esc >= 0 and _ESC_PREFIX.match(data, esc, cut):
        cut = esc
    if cut and data[cut - 1] == 0x0D:
        cut -= 1
    return cut


# ---- the tools ----------------------------------------------------------------------------
# Each takes the context positionally and the model's arguments as keywords, so a missing or
# unexpected argument raises the usual TypeError, e.g. "shell_view() missing 1 required
# positional argument: 'id'".


def shell_exec(ctx: _Context, /, id, command, block=True, timeout=20.0) -> str:
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
        head, body = ctx.helper(
            ["spawn", sdir, "0", wait, *ctx.spawn_limits, "--", "bash", "-c", command], workdir=WORKSPACE
        )
        if head[0] == "done":
            text = _with_omitted(_clean(body), _dropped(head, 2))
            return text if text.strip() else NO_OUTPUT
        if head[0] == "timeout":
            ctx.sessions.set(id, kind=KIND_BLOCKING, offset="0", done="0")
            return TIMED_OUT.format(timeout=timeout, id=id)
    else:
        head, _ = ctx.helper(
            ["spawn", sdir, "1", "-", *ctx.spawn_limits, "--", "bash", "-c", command],
            workdir=WORKSPACE,
            environment={"PYTHONUNBUFFERED": "1"},
        )
        if head[0] == "exists":
            return EXISTS.format(id=id)
        if head[0] == "started":
            ctx.sessions.set(id, kind=KIND_INTERACTIVE, offset="0", done="0")
            return STARTED.format(id=id)
    raise RuntimeError(f"unexpected reply from tp-session spawn: {' '.join(head)}")


def shell_view(ctx: _Context, /, id) -> str:
    _require_str("id", id)
    record = ctx.session(id)
    if not record:
        return NO_SESSION.format(id=id)
    offset = int(record.get("offset") or 0)
    if record.get("kind") == KIND_BLOCKING:
        if record.get("done") == "1":
            return TERMINATED_NO_NEW
        head, body = ctx.helper(["read", session_dir(id), "0", "--if-exited", *ctx.read_max])
        if head[0] == "missing":
            return NO_SESSION.format(id=id)
        if head[0] == "running":
            return STILL_RUNNING
        ctx.sessions.set(id, done="1", offset=head[1])
        return _with_omitted(_clean(body), _dropped(head, 3)) + COMPLETED
    head, body = ctx.helper(["read", session_dir(id), str(offset), *ctx.read_max])
    if head[0] == "missing":
        return NO_SESSION.format(id=id)
    exited, dropped = head[0] == "exited", _dropped(head, 3)
    used = len(body) if exited else _complete_len(body)
    if used or dropped:
        ctx.sessions.set(id, offset=str(offset + dropped + used))
    text = _with_omitted(_clean(body[:used], pty=True), dropped)
    if exited:
        return text + TERMINATED if text else TERMINATED_NO_NEW
    return text if text else IDLE


def shell_write_to_process(ctx: _Context, /, id, command) -> str:
    _require_str("id", id)
    _require_str("command", command)
    record = ctx.session(id)
    if record.get("kind") != KIND_INTERACTIVE:
        return NO_ACTIVE.format(id=id)
    head, body = ctx.helper(["write", session_dir(id), command, *ctx.read_max])
    if head[0] not in ("running", "exited"):
        return NO_ACTIVE.format(id=id)
    exited, start, capped, dropped = head[0] == "exited", int(head[1]), head[3] == "1", _dropped(head, 4)
    used = len(body) if exited else _complete_len(body)
    ctx.sessions.set(id, offset=str(start + dropped + used))
    text = _with_omitted(_clean(body[:used], pty=True), dropped)
    if exited:
        return text + WRITE_TERMINATED
    if capped:
        return text + STILL_OUTPUTTING
    return text if text.strip() else SENT_NO_OUTPUT.format(id=id)


def shell_kill_process(ctx: _Context, /, id) -> str:
    _require_str("id", id)
    if not ctx.session(id):
        return NO_SESSION.format(id=id)
    head, _ = ctx.helper(["kill", session_dir(id)])
    return KILLED.format(id=id) if head[0] == "killed" else NOT_RUNNING.format(id=id)


def shell_write_content_to_file(ctx: _Context, /, content, file_path) -> str:
    _require_str("content", content)
    _require_str("file_path", file_path)
    try:
        data = content.encode("utf-8")
        path = posixpath.normpath(posixpath.join(WORKSPACE, file_path))
        path = "/" + path.lstrip("/")
        if path == "/" or file_path.endswith("/"):
            raise IsADirectoryError(f"Is a directory: '{path}'")
        root = is_root(container_user(ctx.container))
        # Through the server: as the container's user, no put_archive. Where that cannot be done
        # the plain way ("denied": no permission, a special file or filesystem), or for root
        # when the parents cannot be made in place, put_archive below does it as before.
        served = ctx.put_file(path, data)
        if served is not None:
            status, reason = served
            if status == "ok":
                return WRITTEN.format(path=file_path)
            if status == "error" and not root:
                raise OSError(reason)
        # put_archive would replace a directory at `path` by the file, contents and all: refuse.
        uid = gid = 0
        if root:
            # put_archive creates missing parents (as root); a HEAD request stats the target.
            if ctx.is_directory(path):
                raise IsADirectoryError(f"Is a directory: '{path}'")
        else:
            # Create missing parents as the container's user (so they are theirs), check the
            # target, and learn the numeric ids the archive's file must carry.
            out, err = ctx.run_helper(["mkparents", path])
            ids = out.split()
            if len(ids) != 2 or not all(i.isdigit() for i in ids):
                raise OSError((err or out).decode("utf-8", "replace").strip())
            uid, gid = int(ids[0]), int(ids[1])
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), 0o644, uid, gid, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        if not ctx.container.put_archive("/", buf.getvalue()):
            raise OSError("the container refused the archive")
    except Exception as exc:
        if _is_infrastructure_error(exc):
            raise
        reason = getattr(exc, "explanation", None) if isinstance(exc, docker.errors.APIError) else None
        return WRITE_FAILED.format(path=file_path, reason=reason or str(exc) or type(exc).__name__)
    return WRITTEN.format(path=file_path)


_TOOLS = {
    f.__name__: f
    for f in (shell_exec, shell_view, shell_write_to_process, shell_write_content_to_file, shell_kill_process)
}
