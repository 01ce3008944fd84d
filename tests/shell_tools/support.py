"""What the terminal tools' tests share (tests/shell_tools): the observation texts, a tool
caller per transport (Shell), test containers (make_env) and the tp-session server's process
table."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from unittest import mock

import pytest

from environments.docker_client import KnownContainer
from environments.session_helper import CTL_DIR, CTL_SOCKET, HELPER_PATH, prepare_container
from environments.tools import run_tool, transport

ROOT = Path(__file__).resolve().parents[2]
MODES = ["exec", "socket"]

# The reference's schemas, byte for byte: policies were trained on this exact text.
SCHEMAS_SHA256 = "d1bb603e0a31263271ac635f85a6140cd0433bab003bfbd4090280fcad86b5cc"

NO_OUTPUT = "Command executed successfully (no output)."
IDLE = (
    "[No new output]\nSession is running but idle. Actions could take:\n"
    "  - For interactive sessions: Send input with shell_write_to_process()\n"
    "  - For long tasks: Check again later (don't poll too frequently)"
)
STILL_RUNNING = (
    "[Process still running]\nCommand is executing in background. Check again later for output.\n"
    "Use shell_kill_process() to terminate if needed."
)
TERMINATED_NO_NEW = "--- SESSION TERMINATED (no new output) ---"
WARNING = (
    "\n--- WARNING: Process is still actively outputting after max wait time. "
    "Consider waiting before sending the next command. ---"
)


def started(sid):
    return (
        f"Session '{sid}' started.\n\nYou could use:\n  - shell_view('{sid}') - get output\n"
        f"  - shell_write_to_process('{sid}', '<input>') - send input\n  - shell_kill_process('{sid}') - terminate"
    )


def timed_out(timeout, sid):
    return (
        f"Command did not complete within {timeout} seconds. Process continues in background as session "
        f"'{sid}'.\n\nYou can use:\n  - shell_view('{sid}') - get output\n  - shell_kill_process('{sid}') - terminate"
    )


class DictSessions:
    """The sessions store, backed by a plain dict (Redis in production)."""

    def __init__(self, backing: dict):
        self.backing = backing

    def get(self, sid):
        return dict(self.backing.get(sid, {}))

    def set(self, sid, **fields):
        assert all(isinstance(v, str) for v in fields.values()), fields
        self.backing.setdefault(sid, {}).update(fields)


def _fell_back(*args, **kwargs):
    pytest.fail("the tool call fell back to docker exec")


class Shell:
    """One run's view of the tools: a container, its sessions store and, in socket mode, the host
    path of its server's socket. Unless `fallback`, a socket-mode call must not use docker exec."""

    def __init__(self, container, backing=None, expose_kill=False, ctl_socket=None, fallback=False):
        self.container = container
        self.backing = {} if backing is None else backing
        self.sessions = DictSessions(self.backing)
        self.expose_kill = expose_kill
        self.ctl_socket = ctl_socket
        self.fallback = fallback

    def __call__(self, name, **arguments):
        if self.ctl_socket and not self.fallback:
            with mock.patch.object(transport.HelperTransport, "run_exec", _fell_back):
                return self.call(name, arguments)
        return self.call(name, arguments)

    def call(self, name, arguments):
        return run_tool(
            self.container, name, arguments, self.sessions, expose_kill=self.expose_kill, ctl_socket=self.ctl_socket
        )

    def view_until(self, sid, done, timeout=15.0):
        """shell_view repeatedly; returns the list of observations up to the first `done` one."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen.append(self("shell_view", id=sid))
            if done(seen[-1]):
                return seen
            time.sleep(0.2)
        raise AssertionError(f"gave up waiting; observations: {seen}")


TERMINATED = "\n\n--- SESSION TERMINATED ---"


def drain(sh, sid, timeout=15.0) -> str:
    """All the output a session still has, read by shell_view until the end is reported.
    Whether the end comes with the last output or in a view of its own depends on timing."""
    seen = sh.view_until(sid, lambda o: o == TERMINATED_NO_NEW or o.endswith(TERMINATED), timeout)
    last = seen[-1][: -len(TERMINATED)] if seen[-1].endswith(TERMINATED) else ""
    return "".join(o for o in seen[:-1] if o != IDLE) + last


WRITE_TERMINATED = "\n--- SESSION TERMINATED ---"


# The machine these tests run on may be very busy (other suites, benchmarks). A process can
# then pause longer than the 0.5 s a write waits for quiet, so the rest of a reply shows up in
# later views: the helpers below check that the pieces add up to exactly the expected text.
def settle(sh, sid, reply, expected, timeout=30.0) -> str:
    text, deadline = reply, time.monotonic() + timeout
    while text != expected and expected.startswith(text) and time.monotonic() < deadline:
        more = sh("shell_view", id=sid)
        if more == IDLE:
            time.sleep(0.2)
        else:
            text += more
    return text


def settle_end(sh, sid, reply) -> str:
    """The output of a write that ends the process: from the reply, or the reply plus views."""
    if reply.endswith(WRITE_TERMINATED):
        return reply[: -len(WRITE_TERMINATED)]
    return reply + drain(sh, sid)


def wait_for(container, shell_test, timeout=30.0):
    """Poll a condition inside the container (as root, outside the tools under test)."""
    deadline = time.monotonic() + timeout
    while container.exec_run(["sh", "-c", shell_test], user="root").exit_code != 0:
        assert time.monotonic() < deadline, f"timed out waiting for: {shell_test}"
        time.sleep(0.1)


def processes(container) -> str:
    """The command lines of all processes in the container, one a line."""
    out = container.exec_run(["sh", "-c", "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"]).output
    return out.decode("utf-8", "replace")


def make_container(client, image, **kwargs):
    return client.containers.run(
        image, ["sleep", "infinity"], detach=True, working_dir="/app", labels={"termpool.test": "1"}, **kwargs
    )


def bare_model(client, container):
    """What the pool passes to the tools: a model built without an inspect, which must do."""
    model = KnownContainer(client, container.name, container.attrs["Config"]["User"])
    model.reload = lambda: pytest.fail("the tools reloaded the container model")
    return model


class Env:
    """A test container and how the tools reach it (`mode`: "exec" or "socket")."""

    def __init__(self, client, container, mode, ctl_dir=None):
        self.client = client
        self.container = container  # a full model, for the tests' own checks
        self.model = bare_model(client, container)
        self.mode = mode
        self.ctl_socket = str(ctl_dir / "ctl.sock") if ctl_dir else None

    def shell(self, backing=None, **kwargs):
        return Shell(self.model, backing, ctl_socket=self.ctl_socket, **kwargs)

    def exec_shell(self, backing=None, **kwargs):
        """The same container, one docker exec per call."""
        return Shell(self.model, backing, **kwargs)

    def remove(self):
        self.container.remove(force=True)


def make_env(client, image, mode, tmp_path_factory, prepare=True, ctl_name="ctl", **kwargs) -> Env:
    """In socket mode a fresh host directory (mode 0777, as the pool makes it) is mounted at
    CTL_DIR and prepare_container starts the server."""
    ctl_dir = None
    if mode == "socket":
        ctl_dir = tmp_path_factory.mktemp(ctl_name)
        ctl_dir.chmod(0o777)
        kwargs["volumes"] = {str(ctl_dir): {"bind": CTL_DIR, "mode": "rw"}}
    env = Env(client, make_container(client, image, **kwargs), mode, ctl_dir)
    if prepare:
        prepare_container(env.model, serve=mode == "socket")
    return env


def proc_table(container) -> list[tuple[int, int, str, str]]:
    """(pid, ppid, state, command line) of every process in the container."""
    script = (
        "for d in /proc/[0-9]*; do s=$(cat $d/stat 2>/dev/null) || continue; "
        "c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null); echo \"${s#*) } @$c\"; echo \"${d#/proc/}\"; done"
    )
    lines = container.exec_run(["sh", "-c", script], user="root").output.decode("utf-8", "replace").splitlines()
    table = []
    for stat, pid in zip(lines[::2], lines[1::2]):
        fields, _, cmdline = stat.partition(" @")
        state, ppid = fields.split()[:2]
        table.append((int(pid), int(ppid), state, cmdline.strip()))
    return table


def server_pid(container) -> int | None:
    """The running server: detached, so its parent is pid 1 (a `serve` still starting, or waiting
    for an old server to go, is the child of its docker exec)."""
    pids = [
        pid
        for pid, ppid, state, cmd in proc_table(container)
        if state != "Z" and ppid == 1 and cmd == f"{HELPER_PATH} serve {CTL_SOCKET}"
    ]
    assert len(pids) <= 1, pids
    return pids[0] if pids else None


def wait_for_server(container, not_pid=None, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while (pid := server_pid(container)) is None or pid == not_pid:
        assert time.monotonic() < deadline, "the server did not come back"
        time.sleep(0.1)
    return pid


def raw_request(path, payload: bytes, *, magic=b"TPS1", length=None) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(magic + struct.pack(">I", len(payload) if length is None else length) + payload)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:  # a refusal leaves the rest of the request unread
            pass
        return reply
