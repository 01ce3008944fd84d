"""A command in a run's container: `bash -c` through one `docker exec`, its stdout and stderr
apart, a time limit, and a way to kill everything it started.

The exec's output is read from Docker's multiplexed stream (the Engine API's "stream format":
an 8-byte header per frame naming stdout or stderr) on the exec's own connection, polled so
the caller can stop it: the time limit and a cancel are checked between reads.

Killing: every process of the command carries MARKER_VAR=<its id> in its environment (Docker
puts the exec's environment on the process it starts, and children inherit it), and the exec's
process leads its own process group (runc starts it as a session leader). KILL_SCRIPT, run by a
second exec as the command's own user (a user can read its own processes' environments; root
cannot read other users' without CAP_SYS_PTRACE, which containers lack), stops every marked
process, then kills each one and every group one of them leads: the group catches children that
cleared their environment, the marker those that left the group (setsid, nohup ... &). Nothing is
written into the container's file system. A process that both cleared its environment and left
the group escapes, as it would escape Harbor's own docker exec.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from environments.session_helper import exec_never_started
from poolcore import failures

MARKER_VAR = "TERMPOOL_COMMAND_ID"
TIMED_OUT_CODE = 124  # as coreutils' timeout exits
POLL_SECONDS = 0.2  # the longest a time limit or a cancel waits to be noticed
EXITED_CHECK_SECONDS = 2.0  # how often Docker is asked whether the command's own process ended
DRAIN_SECONDS = 2.0  # output still read after the process ended, or after the kill
READ_BYTES = 1 << 16
UNKNOWN_USER_TEXT = "unable to find user"  # Docker's refusal of an exec as a user the container lacks

# $1: the marker (an argument, so this script and the greps it starts do not carry it).
KILL_SCRIPT = r"""
marker="$1"
round=0
while [ "$round" -lt 50 ]; do
  round=$((round + 1))
  found=""
  for file in $(grep -lsF -- "$marker" /proc/[0-9]*/environ); do
    pid=${file#/proc/}
    found="$found ${pid%/environ}"
  done
  [ -z "$found" ] && exit 0
  kill -s STOP $found 2>/dev/null
  for pid in $found; do
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
    set -- ${stat##*) }
    [ "$3" = "$pid" ] && kill -s KILL -- "-$pid" 2>/dev/null
  done
  kill -s KILL $found 2>/dev/null
  sleep 0.05
done
echo "processes of the command were still starting after 50 rounds" >&2
exit 1
"""


class UnknownUser(failures.Failure):
    code = "UNKNOWN_USER"


class Cancelled(failures.Failure):
    code = "JOB_CANCELLED"


@dataclass(frozen=True)
class Command:
    """What to run and how (app/command_models.py checked it); `marker` tells its processes apart."""

    command: str
    marker: str
    cwd: str | None = None
    env: dict | None = None
    user: str | None = None
    timeout_sec: float | None = None


class CappedBuffer:
    """The first `limit` bytes of a stream, and whether more came."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


class FrameReader:
    """Docker's multiplexed exec stream, fed in arbitrary pieces: (stream, payload) frames,
    stream 1 for stdout and 2 for stderr."""

    HEADER = struct.Struct(">BxxxL")

    def __init__(self):
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._pending += data
        frames = []
        while len(self._pending) >= self.HEADER.size:
            stream, size = self.HEADER.unpack_from(self._pending)
            end = self.HEADER.size + size
            if len(self._pending) < end:
                break
            frames.append((stream, bytes(self._pending[self.HEADER.size : end])))
            del self._pending[:end]
        return frames


@dataclass
class _Exec:
    """One started exec and what has been read of it."""

    api: object
    container: str
    exec_id: str
    stream: socket.socket  # the exec's connection, upgraded to its output stream
    stdout: CappedBuffer
    stderr: CappedBuffer
    frames: FrameReader

    def read_some(self, timeout: float) -> bool:
        """Read what arrives within `timeout` seconds; False once the stream has ended."""
        if not select.select([self.stream], [], [], timeout)[0]:
            return True
        data = self.stream.recv(READ_BYTES)
        self.take(data)
        return bool(data)

    def take(self, data: bytes) -> None:
        for stream, payload in self.frames.feed(data):
            (self.stderr if stream == 2 else self.stdout).add(payload)

    def drain(self, seconds: float) -> bool:
        """Read until the stream ends or `seconds` pass; whether it ended."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.read_some(min(POLL_SECONDS, deadline - time.monotonic())):
                return True
        return False

    def running(self) -> bool:
        return bool(self.api.exec_inspect(self.exec_id).get("Running"))

    def exit_code(self) -> int:
        """The exit status once Docker has recorded it (a moment after the stream ends)."""
        deadline = time.monotonic() + DRAIN_SECONDS
        state = self.api.exec_inspect(self.exec_id)
        while state.get("Running") and time.monotonic() < deadline:
            time.sleep(0.05)
            state = self.api.exec_inspect(self.exec_id)
        if state.get("ExitCode") is None:  # its connection ended under it (Docker restarting?)
            raise failures.DockerError(
                f"the command's exec ended without an exit status (running: {state.get('Running')})"
            )
        return int(state["ExitCode"])

    def close(self) -> None:
        """Drop the exec's connection, even while a leftover process keeps its output open."""
        with contextlib.suppress(OSError):
            self.stream.shutdown(socket.SHUT_RDWR)
        self.stream.close()


def run(api, container: str, command: Command, output_limit: int, stop: Callable[[], bool]) -> dict:
    """Run `command` in `container` (a name or id) through the low-level Docker API `api`; its
    result: return_code, stdout, stderr, their *_truncated flags and timed_out. `stop()` is
    asked every POLL_SECONDS; when it says True the command is killed and Cancelled raised.
    UnknownUser when the container has no such user."""
    started = _start(api, container, command, output_limit)
    try:
        timed_out = _wait(started, command, stop)
    except Exception as exc:
        if not isinstance(exc, Cancelled):  # this worker gives up on it: leave nothing running
            with contextlib.suppress(Exception):
                kill(api, container, command)
        raise
    finally:
        started.close()
    code = TIMED_OUT_CODE if timed_out else started.exit_code()
    if code == 126 and exec_never_started(api, started.exec_id):
        _refused(started, command)
    return {
        "return_code": code,
        "stdout": started.stdout.text(),
        "stderr": started.stderr.text(),
        "stdout_truncated": started.stdout.truncated,
        "stderr_truncated": started.stderr.truncated,
        "timed_out": timed_out,
    }


def _start(api, container: str, command: Command, output_limit: int) -> _Exec:
    environment = {**(command.env or {}), MARKER_VAR: command.marker}
    exec_id = api.exec_create(
        container,
        ["bash", "-c", command.command],
        stdout=True,
        stderr=True,
        environment=environment,
        workdir=command.cwd,
        user=command.user or "",
    )["Id"]
    stream, first = open_exec_stream(api, exec_id)
    started = _Exec(
        api, container, exec_id, stream, CappedBuffer(output_limit), CappedBuffer(output_limit), FrameReader()
    )
    started.take(first)
    return started


def open_exec_stream(api, exec_id: str) -> tuple[socket.socket, bytes]:
    """Start the exec on a connection of our own (POST /exec/<id>/start, upgraded to the raw
    stream): the connection and the stream's bytes that came with the reply's head. The SDK's
    exec_start(socket=True) hands over the socket under its HTTP client, which may already have
    buffered (and so dropped) the first frames: all the output of an exec Docker refuses at
    once, such as an unknown user's."""
    conn = connect_engine(api)
    body = b'{"Detach": false, "Tty": false}'
    request = (
        f"POST /v{api.api_version}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\n"
        "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    try:
        conn.sendall(request.encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = conn.recv(READ_BYTES)
            if not chunk:
                raise failures.DockerError(f"Docker closed exec {exec_id}'s connection without an answer")
            reply += chunk
    except BaseException:
        conn.close()
        raise
    head, _, first = reply.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1:2]
    if status not in ([b"101"], [b"200"]):
        conn.close()
        text = (head + b" " + first).decode("utf-8", "replace")
        raise failures.DockerError(f"starting exec {exec_id} failed: {text[:500]}")
    return conn, first


def connect_engine(api) -> socket.socket:
    """A new connection to the Docker engine `api` talks to: its unix socket, or a plain TCP
    address (a TLS or SSH engine is not supported here)."""
    socket_path = getattr(api.get_adapter(api.base_url), "socket_path", None)
    if socket_path:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(socket_path)
        return conn
    address = urllib.parse.urlsplit(api.base_url)
    if address.scheme != "http" or not address.hostname:
        raise failures.DockerError(f"commands need a Docker engine on a unix socket or plain TCP, not {api.base_url}")
    return socket.create_connection((address.hostname, address.port or 2375))


def _wait(started: _Exec, command: Command, stop: Callable[[], bool]) -> bool:
    """Read the output until the command ends; True when its time limit passed (it was killed
    then). Cancelled once `stop()` says so (it was killed too). A command whose own process
    ended while a process it left keeps the output open ends DRAIN_SECONDS later."""
    begun = time.monotonic()
    deadline = None if command.timeout_sec is None else begun + command.timeout_sec
    next_check, exited_at = begun + EXITED_CHECK_SECONDS, None
    while started.read_some(POLL_SECONDS):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            kill(started.api, started.container, command)
            started.drain(DRAIN_SECONDS)
            return True
        if stop():
            kill(started.api, started.container, command)
            raise Cancelled(f"cancelled by its client after {now - begun:.1f} s; every process it started was killed")
        if exited_at is None and now >= next_check:
            exited_at = None if started.running() else now
            next_check = now + EXITED_CHECK_SECONDS
        if exited_at is not None and now - exited_at >= DRAIN_SECONDS:
            return False
    return False


def kill(api, container: str, command: Command) -> str:
    """Kill every process of `command` (module docstring) through an exec as its own user;
    what the kill script said (empty when all went)."""
    exec_id = api.exec_create(
        container, ["sh", "-c", KILL_SCRIPT, "kill-command", command.marker], user=command.user or ""
    )["Id"]
    out, err = api.exec_start(exec_id, demux=True)
    return (err or out or b"").decode("utf-8", "replace").strip()


def _refused(started: _Exec, command: Command) -> None:
    """Docker could not start the exec: UnknownUser for a user the container lacks; any other
    reason (a cwd that does not exist, no bash) stays the result, exit 126 with Docker's text."""
    text = (started.stdout.text() + started.stderr.text()).strip()
    if UNKNOWN_USER_TEXT in text.lower():
        raise UnknownUser(f"user {command.user!r} does not exist in the run's container: {text}")
    if not started.stderr.data:
        started.stderr.add(started.stdout.data)
        started.stdout = CappedBuffer(started.stdout.limit)
