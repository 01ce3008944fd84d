"""The terminal tools (docs/tools.md) against real containers of the test base image.

Observation texts are compared exactly: the policy learned to read them. Every tool test runs
in both transports: one `docker exec` per call ("exec"), and the container's tp-session server
over a unix socket in a host directory mounted at CTL_DIR ("socket"; a call that falls back to
docker exec fails the test there).
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import socket
import statistics
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from unittest import mock

import docker
import pytest

from environments.docker_client import KnownContainer
from environments.session_helper import CTL_DIR, CTL_SOCKET, HELPER_PATH, SESSIONS_ROOT, prepare_container, session_dir
from environments.tools import run_tool, schemas, server_socket, tool_schemas, transport

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="module")
def client():
    return docker.from_env()


@pytest.fixture(scope="module", params=MODES)
def env(request, client, base_image, tmp_path_factory):
    e = make_env(client, base_image, request.param, tmp_path_factory)
    try:
        yield e
    finally:
        e.remove()


@pytest.fixture(scope="module")
def container(env):
    return env.container


@pytest.fixture
def sh(env):
    return env.shell()


# ---- schemas ------------------------------------------------------------------------------
@pytest.mark.unit
def test_schemas_are_the_spec_list():
    shipped = schemas.SCHEMAS_FILE
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == SCHEMAS_SHA256
    names = [s["function"]["name"] for s in tool_schemas()]
    assert names == ["shell_exec", "shell_view", "shell_write_to_process", "shell_write_content_to_file"]
    assert tool_schemas() == json.loads(shipped.read_text())
    assert [s["function"]["name"] for s in tool_schemas(True)] == names + ["shell_kill_process"]
    tool_schemas()[0]["function"]["name"] = "mutated"  # callers get copies
    assert tool_schemas()[0]["function"]["name"] == "shell_exec"


# ---- blocking shell_exec --------------------------------------------------------------------
def test_echo(sh):
    assert sh("shell_exec", id="t", command="echo hi") == "hi\n"


def test_workdir_user_and_fresh_shell(sh):
    assert sh("shell_exec", id="t", command="pwd; id -u") == "/workspace\n0\n"
    assert sh("shell_exec", id="t", command="cd /tmp && export FOO=bar && echo $FOO") == "bar\n"
    assert sh("shell_exec", id="t", command="pwd; echo ${FOO:-unset}") == "/workspace\nunset\n"


def test_runs_in_bash(sh):
    assert sh("shell_exec", id="t", command="echo $BASH_VERSION | cut -c1; [[ 1 == 1 ]] && echo ok") == "5\nok\n"


def test_commands_start_with_default_signal_handling(sh):
    cmd = "grep SigIgn /proc/self/status"
    assert sh("shell_exec", id="t", command=cmd) == "SigIgn:\t0000000000000000\n"
    assert sh("shell_exec", id="sig", command=cmd, block=False) == started("sig")
    assert drain(sh, "sig") == "SigIgn:\t0000000000000000\n"


def test_stderr_merged_in_order(sh):
    cmd = "echo one; echo two >&2; echo three; echo four >&2"
    assert sh("shell_exec", id="t", command=cmd) == "one\ntwo\nthree\nfour\n"


def test_ansi_removed_and_invalid_utf8_dropped(sh):
    cmd = r"printf '\033[1;31mred\033[0m plain \033]0;title\007\xff\xfeok\n'"
    assert sh("shell_exec", id="t", command=cmd) == "red plain ok\n"


@pytest.mark.parametrize("command", ["true", "false", "echo", "printf '  \\n\\t '", "exit 3"])
def test_no_output_text(sh, command):
    assert sh("shell_exec", id="t", command=command) == NO_OUTPUT


def test_multibyte_output(sh):
    assert sh("shell_exec", id="t", command="printf 'héllo wörld ✓ 🎉\\n'") == "héllo wörld ✓ 🎉\n"


def test_large_output_is_complete(sh):
    # 61 kB: just under OBSERVATION_LIMIT (64 KiB; beyond it see tests/test_output_caps.py)
    expected = "".join(f"{i}\n" for i in range(1, 12001))
    assert sh("shell_exec", id="t", command="seq 1 12000") == expected


def test_null_timeout_means_no_limit(sh):
    assert sh("shell_exec", id="t", command="sleep 1.2; echo ok", timeout=None) == "ok\n"


def test_background_job_does_not_hold_blocking_call(sh):
    start = time.monotonic()
    assert sh("shell_exec", id="t", command="sleep 30 & echo started") == "started\n"
    assert time.monotonic() - start < 15


def test_blocking_timeout_becomes_session(sh, container):
    cmd = "echo begin; while [ ! -e /tmp/go-slow ]; do sleep 0.05; done; echo end"
    reply = sh("shell_exec", id="slow", command=cmd, timeout=1)
    assert reply == timed_out(1, "slow")
    assert sh("shell_view", id="slow") == STILL_RUNNING
    assert sh("shell_view", id="slow") == STILL_RUNNING
    container.exec_run(["touch", "/tmp/go-slow"])
    seen = sh.view_until("slow", lambda o: o != STILL_RUNNING)
    assert seen[-1] == "begin\nend\n\n\n--- SESSION COMPLETED ---"
    assert sh("shell_view", id="slow") == TERMINATED_NO_NEW
    assert sh("shell_view", id="slow") == TERMINATED_NO_NEW
    # not an interactive session: no stdin to write to
    assert (
        sh("shell_write_to_process", id="slow", command="x")
        == "Error: No active non-blocking session found with ID 'slow'."
    )


def test_blocking_timeout_text_uses_given_number(sh):
    assert sh("shell_exec", id="slow2", command="sleep 60", timeout=0.5) == timed_out(0.5, "slow2")
    assert sh("shell_exec", id="slow3", command="sleep 60", block=True, timeout=0.25) == timed_out(0.25, "slow3")


def test_blocking_run_does_not_disturb_session_with_same_id(sh):
    assert sh("shell_exec", id="srv", command="cat", block=False) == started("srv")
    assert sh("shell_exec", id="srv", command="echo quick") == "quick\n"
    assert settle(sh, "srv", sh("shell_write_to_process", id="srv", command="ping"), "ping\nping\n") == "ping\nping\n"


# ---- non-blocking sessions ------------------------------------------------------------------
@pytest.mark.parametrize("block", [False, None])
def test_non_blocking_session(sh, block):
    sid = f"nb-{block}"
    cmd = "echo first; sleep 1; echo second"
    assert sh("shell_exec", id=sid, command=cmd, block=block) == started(sid)
    assert drain(sh, sid) == "first\nsecond\n"
    assert sh("shell_view", id=sid) == TERMINATED_NO_NEW


def test_non_blocking_has_pty_and_unbuffered_python(sh):
    cmd = "tty >/dev/null && echo tty; echo $PYTHONUNBUFFERED; exec sleep 30"
    assert sh("shell_exec", id="pty", command=cmd, block=False) == started("pty")
    seen = sh.view_until("pty", lambda o: o.endswith("1\n"), timeout=5)
    assert seen[-1] == "tty\n1\n"
    assert sh("shell_view", id="pty") == IDLE


def test_duplicate_running_id(sh):
    assert sh("shell_exec", id="dup", command="sleep 30", block=False) == started("dup")
    assert (
        sh("shell_exec", id="dup", command="echo again", block=False)
        == "Error: Session 'dup' already exists and is running. Use a different ID or kill the existing session first."
    )


def test_finished_id_can_be_reused(sh):
    assert sh("shell_exec", id="re", command="echo one", block=False) == started("re")
    assert drain(sh, "re") == "one\n"
    assert sh("shell_exec", id="re", command="echo two", block=False) == started("re")
    assert drain(sh, "re") == "two\n"


def test_view_unknown_id(sh):
    assert sh("shell_view", id="nope") == "Error: No session found with ID 'nope'."


def test_odd_ids(sh):
    for sid in ["../../etc", "a/b c", "", "ü" * 150, "x" * 300]:
        assert sh("shell_exec", id=sid, command="echo $((6*7))", block=False) == started(sid)
        assert drain(sh, sid) == "42\n", sid


def test_multibyte_character_split_across_reads(sh, container):
    # "é" and "🎉" are written in two parts, the second only when the test says so.
    script = (
        "import os,sys,time\n"
        "def wait(f):\n"
        "    while not os.path.exists(f): time.sleep(0.05)\n"
        "o=sys.stdout.buffer\n"
        "o.write(b'a\\xc3'); o.flush(); wait('/tmp/utf1')\n"
        "o.write(b'\\xa9b\\xf0\\x9f'); o.flush(); wait('/tmp/utf2')\n"
        "o.write(b'\\x8e\\x89c\\n'); o.flush(); time.sleep(60)\n"
    )
    sh("shell_write_content_to_file", content=script, file_path="split.py")
    out = session_dir("utf") + "/out"
    assert sh("shell_exec", id="utf", command="python3 split.py", block=False) == started("utf")
    wait_for(container, f"[ $(wc -c < {out}) = 2 ]")
    assert sh("shell_view", id="utf") == "a"
    assert sh("shell_view", id="utf") == IDLE  # the lone lead byte waits for the rest
    container.exec_run(["touch", "/tmp/utf1"])
    wait_for(container, f"[ $(wc -c < {out}) = 6 ]")
    assert sh("shell_view", id="utf") == "éb"
    container.exec_run(["touch", "/tmp/utf2"])
    wait_for(container, f"[ $(wc -c < {out}) = 11 ]")
    assert sh("shell_view", id="utf") == "🎉c\n"


def test_escape_sequence_split_across_reads(sh, container):
    cmd = r"printf 'x\033[3'; while [ ! -e /tmp/esc1 ]; do sleep 0.05; done; printf '1my\033[0m\n'; sleep 60"
    out = session_dir("esc") + "/out"
    assert sh("shell_exec", id="esc", command=cmd, block=False) == started("esc")
    wait_for(container, f"[ $(wc -c < {out}) = 4 ]")
    assert sh("shell_view", id="esc") == "x"
    container.exec_run(["touch", "/tmp/esc1"])
    wait_for(container, f"grep -q y {out}")
    assert sh("shell_view", id="esc") == "y\n"


def test_tail_of_fast_exiting_session_is_kept(sh):
    expected = "".join(f"{i}\n" for i in range(1, 10001)) + "END"  # within OBSERVATION_LIMIT with CRLF
    for n in range(3):
        sid = f"tail{n}"
        assert sh("shell_exec", id=sid, command="seq 1 10000; printf END", block=False) == started(sid)
        assert drain(sh, sid) == expected


# ---- shell_write_to_process -----------------------------------------------------------------
def test_write_to_python(sh):
    assert sh("shell_exec", id="py", command="python3 -q", block=False) == started("py")
    sh.view_until("py", lambda o: o.endswith(">>> "), timeout=10)
    reply = sh("shell_write_to_process", id="py", command="print(6*7)")
    assert reply.startswith("print(6*7)\n")  # the terminal echoes the input at once
    assert settle(sh, "py", reply, "print(6*7)\n42\n>>> ") == "print(6*7)\n42\n>>> "
    reply = sh("shell_write_to_process", id="py", command="print('é' * 3)")
    assert settle(sh, "py", reply, "print('é' * 3)\nééé\n>>> ") == "print('é' * 3)\nééé\n>>> "
    assert sh("shell_view", id="py") == IDLE
    assert settle_end(sh, "py", sh("shell_write_to_process", id="py", command="exit()")) == "exit()\n"
    assert sh("shell_view", id="py") == TERMINATED_NO_NEW
    assert (
        sh("shell_write_to_process", id="py", command="print(1)")
        == "Error: No active non-blocking session found with ID 'py'."
    )


def test_write_to_bash_read_loop_discards_unviewed_output(sh, container):
    cmd = 'echo banner; while read -r line; do echo "got:$line"; done'
    assert sh("shell_exec", id="loop", command=cmd, block=False) == started("loop")
    # "banner" is printed but never viewed: the write skips it
    wait_for(container, f"grep -q banner {session_dir('loop')}/out")
    assert (
        settle(sh, "loop", sh("shell_write_to_process", id="loop", command="abc"), "abc\ngot:abc\n") == "abc\ngot:abc\n"
    )
    assert (
        settle(sh, "loop", sh("shell_write_to_process", id="loop", command="d e"), "d e\ngot:d e\n") == "d e\ngot:d e\n"
    )
    assert sh("shell_view", id="loop") == IDLE


def test_write_output_ending_the_process(sh):
    cmd = "read -r x; seq 1 5000; printf done"
    assert sh("shell_exec", id="end", command=cmd, block=False) == started("end")
    expected = "go\n" + "".join(f"{i}\n" for i in range(1, 5001)) + "done"
    assert settle_end(sh, "end", sh("shell_write_to_process", id="end", command="go")) == expected
    assert sh("shell_view", id="end") == TERMINATED_NO_NEW


def test_write_with_no_output(sh):
    assert sh("shell_exec", id="quiet", command="stty -echo; echo ready; cat >/dev/null", block=False) == started(
        "quiet"
    )
    assert sh.view_until("quiet", lambda o: o != IDLE)[-1] == "ready\n"
    assert (
        sh("shell_write_to_process", id="quiet", command="secret")
        == "Input sent to session 'quiet' successfully (no output)."
    )


def test_write_still_outputting_warning(sh):
    cmd = "read -r x; while true; do echo tick; sleep 0.1; done"
    assert sh("shell_exec", id="chatty", command=cmd, block=False) == started("chatty")
    start = time.monotonic()
    reply = sh("shell_write_to_process", id="chatty", command="go")
    assert 4.9 < time.monotonic() - start < 30
    assert reply.startswith("go\ntick\n") and reply.endswith(WARNING)
    assert set(reply[3 : -len(WARNING)].splitlines()) == {"tick"}


def test_write_to_unknown_session(sh):
    assert (
        sh("shell_write_to_process", id="ghost", command="hi")
        == "Error: No active non-blocking session found with ID 'ghost'."
    )


def test_helper_killed_mid_call_is_an_error_not_a_retry(sh, container):
    # The command kills the tp-session that runs it (its supervisor's parent): the call ends with
    # no reply. The command must not be run a second time (socket mode must not fall back).
    cmd = "echo ran >> /tmp/once; kill -9 $(cut -d' ' -f4 /proc/$PPID/stat); sleep 0.2"
    assert (
        sh("shell_exec", id="once", command=cmd)
        == "[TOOL_ERROR] shell_exec: RuntimeError: tp-session spawn failed: no output"
    )
    time.sleep(0.5)
    assert container.exec_run(["cat", "/tmp/once"]).output == b"ran\n"
    container.exec_run(["sh", "-c", f"rm -rf /tmp/once {SESSIONS_ROOT}/*.run.*"])


# ---- shell_write_content_to_file ------------------------------------------------------------
def test_write_relative_absolute_nested(sh, container):
    content = "héllo\n  wörld\n\tno newline at end"
    assert (
        sh("shell_write_content_to_file", content=content, file_path="notes.txt")
        == "Content successfully written to 'notes.txt' in Docker container."
    )
    assert (
        sh("shell_write_content_to_file", content=content, file_path="deep/er/notes.txt")
        == "Content successfully written to 'deep/er/notes.txt' in Docker container."
    )
    assert (
        sh("shell_write_content_to_file", content="", file_path="/tmp/a/b/c/empty")
        == "Content successfully written to '/tmp/a/b/c/empty' in Docker container."
    )
    for path in ["/workspace/notes.txt", "/workspace/deep/er/notes.txt"]:
        assert container.exec_run(["cat", path]).output == content.encode()
    assert container.exec_run(["stat", "-c", "%s %a %U", "/tmp/a/b/c/empty"]).output == b"0 644 root\n"
    assert container.exec_run(["stat", "-c", "%a %U", "/tmp/a", "/tmp/a/b/c"]).output == b"755 root\n" * 2
    assert sh("shell_write_content_to_file", content="v2", file_path="./notes.txt").startswith("Content successfully")
    assert sh("shell_exec", id="t", command="cat notes.txt") == "v2"


def test_write_replaces_file_and_symlink(sh, container):
    container.exec_run(
        [
            "sh",
            "-c",
            "cd /workspace && echo old > target && chmod 755 target && ln target hard && "
            "ln -s target link && ln -s /etc/hostname abslink",
        ]
    )
    for name in ["target", "link", "abslink"]:
        assert sh("shell_write_content_to_file", content=name, file_path=name).startswith("Content successfully")
    out = container.exec_run(
        [
            "sh",
            "-c",
            "cd /workspace && stat -c '%n %F %a' target link abslink hard && "
            "cat target; echo; cat link; echo; cat abslink; echo; cat hard",
        ]
    ).output
    # a new file each time (put_archive's way): the hard link keeps the old content, links are replaced
    assert out.decode() == (
        "target regular file 644\nlink regular file 644\nabslink regular file 644\n"
        "hard regular file 755\ntarget\nlink\nabslink\nold\n"
    )
    assert container.exec_run(["cat", "/etc/hostname"]).output.strip() != b"abslink"


def test_write_to_special_file_leaves_it_alone(sh, container):
    # In socket mode the server declines (not a plain file), so put_archive does what it always
    # did: it writes beneath the container's mounts; /dev/null stays a device.
    assert sh("shell_write_content_to_file", content="x", file_path="/dev/null").startswith("Content successfully")
    assert container.exec_run(["sh", "-c", "[ -c /dev/null ] && echo device"]).output == b"device\n"


def test_write_failures(sh, container):
    container.exec_run(["sh", "-c", "mkdir -p /workspace/dir && touch /workspace/dir/keep"])
    assert (
        sh("shell_write_content_to_file", content="x", file_path="dir")
        == "Error writing to file 'dir' in Docker container: Is a directory: '/workspace/dir'"
    )
    assert container.exec_run(["ls", "/workspace/dir"]).output == b"keep\n"  # not clobbered
    reply = sh("shell_write_content_to_file", content="x", file_path="/etc/passwd/x")
    assert reply.startswith("Error writing to file '/etc/passwd/x' in Docker container: ")
    assert "not a directory" in reply


# ---- errors -----------------------------------------------------------------------------
def test_unknown_tool(sh):
    assert sh("shell_kill_process", id="x") == "[TOOL_ERROR] unknown tool: shell_kill_process"
    assert sh("rm_rf") == "[TOOL_ERROR] unknown tool: rm_rf"
    assert run_tool(sh.container, None, {}, sh.sessions) == "[TOOL_ERROR] unknown tool: None"


def test_bad_arguments(sh):
    assert (
        sh("shell_exec", id="t")
        == "[TOOL_ERROR] shell_exec: TypeError: shell_exec() missing 1 required positional argument: 'command'"
    )
    assert (
        sh("shell_view")
        == "[TOOL_ERROR] shell_view: TypeError: shell_view() missing 1 required positional argument: 'id'"
    )
    assert (
        sh("shell_exec", id="t", command="echo", colour="red")
        == "[TOOL_ERROR] shell_exec: TypeError: shell_exec() got an unexpected keyword argument 'colour'"
    )
    assert (
        sh("shell_exec", id="t", command="echo", block="false")
        == "[TOOL_ERROR] shell_exec: TypeError: block must be a boolean or null, not str"
    )
    assert (
        sh("shell_exec", id="t", command="echo", timeout="5")
        == "[TOOL_ERROR] shell_exec: TypeError: timeout must be a number or null, not str"
    )
    assert (
        sh("shell_exec", id="t", command=["echo"])
        == "[TOOL_ERROR] shell_exec: TypeError: command must be a string, not list"
    )
    assert (
        sh("shell_write_content_to_file", content=None, file_path="x")
        == "[TOOL_ERROR] shell_write_content_to_file: TypeError: content must be a string, not NoneType"
    )
    assert (
        run_tool(sh.container, "shell_view", ["x"], sh.sessions)
        == "[TOOL_ERROR] shell_view: TypeError: arguments must be an object, not list"
    )
    assert (
        run_tool(sh.container, "shell_view", None, sh.sessions)
        == "[TOOL_ERROR] shell_view: TypeError: shell_view() missing 1 required positional argument: 'id'"
    )


# ---- state outlives the worker ------------------------------------------------------------
def test_sessions_survive_worker_restart(env):
    backing = {}
    first = env.shell(backing)
    assert first("shell_exec", id="keep", command="python3 -q", block=False) == started("keep")
    first.view_until("keep", lambda o: o.endswith(">>> "), timeout=10)
    assert first("shell_exec", id="bg", command="sleep 1; echo late", timeout=0.2) == timed_out(0.2, "bg")
    del first
    # A new worker process: a fresh docker client, a fresh store object over the same data.
    fresh_client = docker.from_env()
    second = Shell(bare_model(fresh_client, env.container), backing, ctl_socket=env.ctl_socket)
    expected = "x = 5; print(x + 1)\n6\n>>> "
    assert (
        settle(second, "keep", second("shell_write_to_process", id="keep", command="x = 5; print(x + 1)"), expected)
        == expected
    )
    seen = second.view_until("bg", lambda o: o != STILL_RUNNING)
    assert seen[-1] == "late\n\n\n--- SESSION COMPLETED ---"
    fresh_client.close()


def test_kill_is_opt_in(env, container):
    sh = env.shell(expose_kill=True)
    assert sh("shell_exec", id="k", command="echo up; sleep 61 & sleep 61", block=False) == started("k")
    sh.view_until("k", lambda o: o == "up\n", timeout=5)
    assert sh("shell_kill_process", id="k") == "Process in session 'k' has been terminated."
    assert drain(sh, "k") == ""
    assert sh("shell_kill_process", id="k") == "Session 'k' is not running."
    assert sh("shell_kill_process", id="other") == "Error: No session found with ID 'other'."
    assert "sleep 61" not in processes(container)


# ---- other images and users ---------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_non_root_user(client, base_image, mode, tmp_path_factory):
    # named user: one put_archive plus one chown (plus, in socket mode, the server as nobody)
    e = make_env(client, base_image, mode, tmp_path_factory, user="nobody")
    try:
        sh = e.shell()
        assert sh("shell_exec", id="t", command="id -un; pwd; touch mine && echo ok") == "nobody\n/workspace\nok\n"
        assert sh("shell_write_content_to_file", content="hi", file_path="a/b.txt").startswith("Content successfully")
        assert (
            sh("shell_exec", id="t", command="stat -c '%U %n' a a/b.txt; echo more >> a/b.txt && cat a/b.txt")
            == "nobody a\nnobody a/b.txt\nhimore\n"
        )
        assert (
            sh("shell_write_content_to_file", content="x", file_path="/root/x/y.txt")
            == "Error writing to file '/root/x/y.txt' in Docker container: "
            "cannot create directory '/root/x': Permission denied"
        )
        assert (
            sh("shell_write_content_to_file", content="x", file_path="a")
            == "Error writing to file 'a' in Docker container: Is a directory: '/workspace/a'"
        )
        # where nobody may not create the file itself, put_archive (as root) does, as it always did
        assert sh("shell_write_content_to_file", content="x", file_path="/etc/tp-x").startswith("Content successfully")
        assert e.container.exec_run(["stat", "-c", "%U %a", "/etc/tp-x"]).output == b"nobody 644\n"
        assert sh("shell_exec", id="s", command="id -un", block=False) == started("s")
        assert drain(sh, "s") == "nobody\n"
    finally:
        e.remove()


@pytest.mark.parametrize("mode", MODES)
def test_numeric_user_and_sh_only_image_unprepared(client, base_image, mode, tmp_path_factory):
    e = make_env(client, base_image, mode, tmp_path_factory, prepare=False, user="1234:1234")
    c = e.container
    try:
        c.exec_run(["rm", "-f", "/usr/bin/bash", "/bin/bash"], user="root")
        # never prepared: the first call installs the helper (and, in socket mode, finds no
        # server, so it goes through docker exec and starts the server for the next calls)
        sh = e.shell(fallback=True)
        assert (
            sh("shell_write_content_to_file", content="hi", file_path="new/f.txt")
            == "Content successfully written to 'new/f.txt' in Docker container."
        )
        assert sh("shell_exec", id="t", command="echo from $(id -u); cat new/f.txt") == "from 1234\nhi"
        assert sh("shell_exec", id="t", command="stat -c %u:%g /workspace new new/f.txt") == "1234:1234\n" * 3
        assert sh("shell_exec", id="i", command="read x; echo got $x", block=False) == started("i")
        assert settle_end(sh, "i", sh("shell_write_to_process", id="i", command="it")) == "it\ngot it\n"
        if mode == "socket":
            wait_for(c, f"[ -S {CTL_SOCKET} ]")
            assert e.shell()("shell_exec", id="t", command="echo served as $(id -u)") == "served as 1234\n"
    finally:
        e.remove()


# ---- run-timeout (used to run the tests of a task) --------------------------------------
def test_run_timeout(container):
    start = time.monotonic()
    result = container.exec_run([HELPER_PATH, "run-timeout", "1", "--", "sh", "-c", "echo a; sleep 20 & sleep 30"])
    assert result.exit_code == 124 and result.output.startswith(b"a\n")
    assert time.monotonic() - start < 15
    result = container.exec_run([HELPER_PATH, "run-timeout", "30", "--", "sh", "-c", "echo out; exit 3"])
    assert (result.exit_code, result.output) == (3, b"out\n")
    # stragglers of the group (they would hold the output stream) are ended with it
    result = container.exec_run([HELPER_PATH, "run-timeout", "30", "--", "sh", "-c", "sleep 19 & echo done"])
    assert (result.exit_code, result.output) == (0, b"done\n")
    assert "sleep 19" not in processes(container)
    assert "sleep 20" not in processes(container)


# ---- the tp-session server (socket mode) ----------------------------------------------------
@pytest.fixture(scope="module")
def served(client, base_image, tmp_path_factory):
    """A container of its own with a running server, for the tests that break it on purpose."""
    e = make_env(client, base_image, "socket", tmp_path_factory)
    try:
        yield e
    finally:
        e.remove()


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


def test_same_process_context_in_both_modes(served):
    """What a command sees (environment, ids, limits, signals, descriptors) does not depend on
    the transport."""
    probe = (
        "env | sort; umask; ulimit -a; pwd; ls -1 /proc/self/fd; "
        "grep -E '^(Uid|Gid|Groups|Cap[A-Za-z]*|NoNewPrivs|Seccomp|SigBlk|SigIgn):' /proc/self/status"
    )
    via_socket, via_exec = served.shell(), served.exec_shell()
    blocking = via_socket("shell_exec", id="p", command=probe)
    assert blocking == via_exec("shell_exec", id="p", command=probe)
    assert "\n0\n1\n2\n3\n" in blocking and "\n4\n" not in blocking  # stdio + ls's own: nothing leaked
    assert "PYTHONUNBUFFERED" not in blocking
    assert via_socket("shell_exec", id="ps", command=probe, block=False) == started("ps")
    assert via_exec("shell_exec", id="pe", command=probe, block=False) == started("pe")
    assert drain(via_socket, "ps") == drain(via_exec, "pe")


def test_sessions_are_shared_between_modes(served):
    backing = {}
    via_socket, via_exec = served.shell(backing), served.exec_shell(backing)
    cmd = "read -r v; echo got $v"
    assert via_socket("shell_exec", id="a", command=cmd, block=False) == started("a")
    assert via_exec("shell_exec", id="b", command=cmd, block=False) == started("b")
    assert via_exec("shell_exec", id="a", command="true", block=False).startswith("Error: Session 'a' already")
    assert settle_end(via_exec, "a", via_exec("shell_write_to_process", id="a", command="x")) == "x\ngot x\n"
    assert settle_end(via_socket, "b", via_socket("shell_write_to_process", id="b", command="y")) == "y\ngot y\n"
    assert via_exec("shell_exec", id="slow", command="sleep 1; echo late", timeout=0.2) == timed_out(0.2, "slow")
    assert via_socket.view_until("slow", lambda o: o != STILL_RUNNING)[-1] == "late\n\n\n--- SESSION COMPLETED ---"


def test_server_answers_tells_a_live_server(served, tmp_path):
    """The warm pool's liveness check of a spare: a connection the kernel takes, no Docker call."""
    assert server_socket.server_answers(served.ctl_socket)
    assert not server_socket.server_answers(str(tmp_path / "none.sock"))
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "dead.sock"))  # a socket file nobody listens on: a stopped container's
    dead.close()
    assert not server_socket.server_answers(str(tmp_path / "dead.sock"))
    assert raw_request(served.ctl_socket, b"\0\0read\0/.termpool/none\x000\0").startswith(b"missing ")


def test_a_replaced_helper_answers_at_once(served):
    """The server runs a request in its own code (no exec per call) only while the helper file is
    the one it started from: a helper replaced meanwhile (put_archive, as an upgrade of the
    workers does) answers the very next request."""
    read = b"\0\0read\0/.termpool/none\x000\0"
    assert raw_request(served.ctl_socket, read).startswith(b"missing ")
    stub = b'#!/bin/sh\necho replaced "$@"\n'
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo(HELPER_PATH.lstrip("/"))
        info.size, info.mode = len(stub), 0o755
        tar.addfile(info, io.BytesIO(stub))
    original = b"".join(served.model.get_archive(HELPER_PATH)[0])  # read whole: it holds the container
    assert served.model.put_archive("/", archive.getvalue())
    try:
        assert raw_request(served.ctl_socket, read) == b"replaced read /.termpool/none 0\n"
    finally:
        assert served.model.put_archive(posixpath.dirname(HELPER_PATH), original)
    assert raw_request(served.ctl_socket, read).startswith(b"missing ")


def test_server_refuses_bad_requests(served):
    path = served.ctl_socket
    assert raw_request(path, b"x\0", magic=b"HTTP") == b"tp-session: not a tp-session request\n"
    assert raw_request(path, b"", length=64 << 20) == b"tp-session: request size 67108864 out of range\n"
    assert raw_request(path, b"\0\0read", length=7) == b"tp-session: short request\n"
    assert raw_request(path, b"\0\0read") == b"tp-session: malformed request\n"
    for entry in [b"NOEQUALS", b"=x"]:
        assert raw_request(path, b"\0" + entry + b"\0\0read\0") == b"tp-session: malformed environment entry\n"
    for argv in [b"serve\0/tmp/x.sock\0", b"run-timeout\x001\0--\0id\0", b"/bin/sh\0-c\0id\0", b"", b"\0"]:
        assert raw_request(path, b"\0\0" + argv).startswith(b"tp-session: refused subcommand"), argv
    assert (
        raw_request(path, b"/nowhere\0\0read\0/x\x000\0") == b"tp-session: chdir /nowhere: No such file or directory\n"
    )
    # a client that connects and goes away at once, or sends half a header
    for data in [b"", b"TP"]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(data)
    assert raw_request(path, b"\0\0read\0/nowhere\x000\0") == b"missing 0 -1 0\n"
    assert served.shell()("shell_exec", id="t", command="echo still fine") == "still fine\n"


def test_socket_is_for_its_owner_only(served):
    assert Path(served.ctl_socket).stat().st_mode & 0o777 == 0o600
    connect = f"import socket; socket.socket(socket.AF_UNIX).connect({CTL_SOCKET!r})"
    result = served.container.exec_run(["python3", "-c", connect], user="nobody")
    assert result.exit_code != 0 and b"PermissionError" in result.output


def test_second_serve_exits_at_once(served):
    pid = wait_for_server(served.container)
    start = time.monotonic()
    result = served.container.exec_run([HELPER_PATH, "serve", CTL_SOCKET])
    assert (result.exit_code, result.output) == (0, b"")
    assert time.monotonic() - start < 5
    prepare_container(served.model, serve=True)  # so is preparing a prepared container again
    assert server_pid(served.container) == pid


def test_server_survives_client_killed_mid_call(served):
    container = served.container
    pid = wait_for_server(container)
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import docker
from environments.docker_client import KnownContainer
from environments.tools import run_tool
model = KnownContainer(docker.from_env(), {container.name!r})
class Sessions:
    def get(self, sid): return {{}}
    def set(self, sid, **fields): pass
run_tool(model, "shell_exec", {{"id": "mid", "command": "touch /tmp/mid-started; sleep 2; seq 1 200000"}},
         Sessions(), ctl_socket={served.ctl_socket!r})
"""
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_for(container, "[ -e /tmp/mid-started ]")
    finally:
        worker.kill()
        worker.wait()
    assert served.shell()("shell_exec", id="t", command="echo next") == "next\n"
    # the orphaned call finishes on its own: its output goes nowhere, its scratch dir is removed
    wait_for(container, f"! ls -d {SESSIONS_ROOT}/*.run.* 2>/dev/null")
    assert "sleep 2" not in processes(container)
    assert server_pid(container) == pid


def test_fallback_and_restart_when_server_dies(served, monkeypatch):
    monkeypatch.setattr(server_socket, "RESTART_EVERY", 0.0)
    container, backing = served.container, {}
    sh = served.shell(backing, fallback=True)
    assert sh("shell_exec", id="s", command="read -r v; echo got $v", block=False) == started("s")
    for breakage in ["kill -9 {pid}", f"rm {CTL_SOCKET}"]:  # dead server (stale socket file); socket gone
        pid = wait_for_server(container)
        container.exec_run(["sh", "-c", breakage.format(pid=pid)], user="root")
        original = transport.HelperTransport.run_exec
        with mock.patch.object(transport.HelperTransport, "run_exec", autospec=True, side_effect=original) as via_exec:
            assert sh("shell_exec", id="t", command="echo via exec") == "via exec\n"
        assert via_exec.call_count == 1
        # the call restarted the server in the background: the next calls are served again
        assert wait_for_server(container, not_pid=pid) != pid
        assert served.shell(backing)("shell_exec", id="t", command="echo served") == "served\n"
    # the session started before all this is still there
    assert settle_end(sh, "s", served.shell(backing)("shell_write_to_process", id="s", command="z")) == "z\ngot z\n"


def test_restart_installs_a_missing_helper(served, monkeypatch):
    """A server restart that finds no helper (Docker cannot start it) installs the helper too."""
    monkeypatch.setattr(server_socket, "RESTART_EVERY", 0.0)
    container = served.container
    pid = wait_for_server(container)
    container.exec_run(["sh", "-c", f"kill -9 {pid}; rm -f {HELPER_PATH}"], user="root")
    server_socket.restart_server(served.model, served.ctl_socket)
    assert wait_for_server(container, not_pid=pid) != pid
    assert served.shell()("shell_exec", id="t", command="echo served") == "served\n"


def test_no_zombies_or_stragglers_after_many_calls(served):
    container = served.container
    pid = wait_for_server(container)
    zombies_before = sum(state == "Z" for _, _, state, _ in proc_table(container))
    sh = served.shell()
    for i in range(50):
        if i % 10 == 0:
            assert sh("shell_exec", id=f"z{i}", command=f"echo {i}", block=False) == started(f"z{i}")
            assert drain(sh, f"z{i}") == f"{i}\n"
        elif i % 10 == 5:  # an orphan: the server adopts and reaps it
            assert sh("shell_exec", id="z", command="sleep 0.2 & echo bg") == "bg\n"
        else:
            assert sh("shell_exec", id="z", command="echo hi") == "hi\n"
    time.sleep(0.5)
    table = proc_table(container)
    assert sum(state == "Z" for _, _, state, _ in table) == zombies_before, table
    assert [p for p in table if p[1] == pid] == [], "the server still has children"


def test_server_repairs_removed_workspace_and_helper(served):
    container, sh = served.container, served.shell()
    container.exec_run(["rm", "-rf", "/workspace"])
    assert sh("shell_exec", id="t", command="pwd; ls -A") == "/workspace\n"
    container.exec_run(["rm", "-f", HELPER_PATH])
    assert sh("shell_exec", id="t", command="echo back") == "back\n"
    container.exec_run(["rm", "-f", HELPER_PATH])
    assert sh("shell_write_content_to_file", content="x", file_path="f").startswith("Content successfully")
    assert sh("shell_exec", id="t", command="cat f") == "x"


def test_long_socket_path(client, base_image, tmp_path_factory):
    e = make_env(client, base_image, "socket", tmp_path_factory, ctl_name="c" * 100)
    try:
        assert len(e.ctl_socket) > 108  # more than sun_path holds
        assert e.shell()("shell_exec", id="t", command="echo far") == "far\n"
    finally:
        e.remove()


def test_writes_go_through_the_server(served):
    sh, model = served.shell(), served.model
    model.put_archive = lambda *a, **k: pytest.fail("put_archive used")
    try:
        big = "".join(f"line {i}\n" for i in range(100000))  # larger than a socket buffer
        for path in ["big.txt", "/tmp/new/dir/big.txt", "big.txt"]:
            assert (
                sh("shell_write_content_to_file", content=big, file_path=path)
                == f"Content successfully written to '{path}' in Docker container."
            )
        assert sh("shell_exec", id="t", command="md5sum < big.txt; md5sum < /tmp/new/dir/big.txt") == 2 * (
            hashlib.md5(big.encode()).hexdigest() + "  -\n"
        )
        assert (
            sh("shell_write_content_to_file", content="", file_path="empty")
            == "Content successfully written to 'empty' in Docker container."
        )
        assert served.container.exec_run(["stat", "-c", "%s %a", "/workspace/empty"]).output == b"0 644\n"
    finally:
        del model.put_archive


def test_socket_calls_are_cheaper_than_docker_exec(served):
    """Median of 50 blocking `echo hi`, interleaved on one container: through the server, through
    one docker exec per call, and a bare exec_run for reference."""
    via_socket, via_exec = served.shell(), served.exec_shell()
    runs = {
        "socket": lambda: via_socket("shell_exec", id="b", command="echo hi"),
        "docker exec": lambda: via_exec("shell_exec", id="b", command="echo hi"),
        "raw exec_run": lambda: served.container.exec_run(["bash", "-c", "echo hi"]).output.decode(),
    }
    times = {name: [] for name in runs}
    for _ in range(50):
        for name, run in runs.items():
            start = time.perf_counter()
            assert run() == "hi\n"
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    print("median ms of 50:", ", ".join(f"{name} {ms:.1f}" for name, ms in medians.items()))
    assert medians["socket"] < medians["raw exec_run"]
