"""The terminal tools (spec/TOOLS.md) against real containers of the test base image.

Observation texts are compared exactly: the policy learned to read them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import docker
import pytest

from tasks import shell_tools
from tasks.session_helper import HELPER_PATH, prepare_container, session_dir
from tasks.shell_tools import run_tool, tool_schemas

SPEC_SCHEMAS = Path("/work/shared/spec/tool_schemas.json")

NO_OUTPUT = "Command executed successfully (no output)."
IDLE = ("[No new output]\nSession is running but idle. Actions could take:\n"
        "  - For interactive sessions: Send input with shell_write_to_process()\n"
        "  - For long tasks: Check again later (don't poll too frequently)")
STILL_RUNNING = ("[Process still running]\nCommand is executing in background. Check again later for output.\n"
                 "Use shell_kill_process() to terminate if needed.")
TERMINATED_NO_NEW = "--- SESSION TERMINATED (no new output) ---"
WARNING = ("\n--- WARNING: Process is still actively outputting after max wait time. "
           "Consider waiting before sending the next command. ---")


def started(sid):
    return (f"Session '{sid}' started.\n\nYou could use:\n  - shell_view('{sid}') - get output\n"
            f"  - shell_write_to_process('{sid}', '<input>') - send input\n  - shell_kill_process('{sid}') - terminate")


def timed_out(timeout, sid):
    return (f"Command did not complete within {timeout} seconds. Process continues in background as session "
            f"'{sid}'.\n\nYou can use:\n  - shell_view('{sid}') - get output\n  - shell_kill_process('{sid}') - terminate")


class DictSessions:
    """The sessions store, backed by a plain dict (Redis in production)."""

    def __init__(self, backing: dict):
        self.backing = backing

    def get(self, sid):
        return dict(self.backing.get(sid, {}))

    def set(self, sid, **fields):
        assert all(isinstance(v, str) for v in fields.values()), fields
        self.backing.setdefault(sid, {}).update(fields)


class Shell:
    """One run's view of the tools: a container and its sessions store."""

    def __init__(self, container, backing=None, expose_kill=False):
        self.container = container
        self.backing = {} if backing is None else backing
        self.sessions = DictSessions(self.backing)
        self.expose_kill = expose_kill

    def __call__(self, name, **arguments):
        return run_tool(self.container, name, arguments, self.sessions, expose_kill=self.expose_kill)

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
    last = seen[-1][:-len(TERMINATED)] if seen[-1].endswith(TERMINATED) else ""
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
        return reply[:-len(WRITE_TERMINATED)]
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
    return client.containers.run(image, ["sleep", "infinity"], detach=True, working_dir="/app",
                                 labels={"termpool.test": "1"}, **kwargs)


@pytest.fixture(scope="module")
def client():
    return docker.from_env()


@pytest.fixture(scope="module")
def container(client, base_image):
    c = make_container(client, base_image)
    try:
        prepare_container(c)
        yield c
    finally:
        c.remove(force=True)


@pytest.fixture
def sh(container):
    return Shell(container)


# ---- schemas ------------------------------------------------------------------------------
def test_schemas_are_the_spec_list():
    shipped = Path(shell_tools.__file__).with_name("tool_schemas.json")
    if SPEC_SCHEMAS.exists():
        assert shipped.read_bytes() == SPEC_SCHEMAS.read_bytes()
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
    expected = "".join(f"{i}\n" for i in range(1, 100001))
    assert sh("shell_exec", id="t", command="seq 1 100000") == expected


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
    assert sh("shell_write_to_process", id="slow", command="x") == \
        "Error: No active non-blocking session found with ID 'slow'."


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
    assert sh("shell_exec", id="dup", command="echo again", block=False) == \
        "Error: Session 'dup' already exists and is running. Use a different ID or kill the existing session first."


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
    script = ("import os,sys,time\n"
              "def wait(f):\n"
              "    while not os.path.exists(f): time.sleep(0.05)\n"
              "o=sys.stdout.buffer\n"
              "o.write(b'a\\xc3'); o.flush(); wait('/tmp/utf1')\n"
              "o.write(b'\\xa9b\\xf0\\x9f'); o.flush(); wait('/tmp/utf2')\n"
              "o.write(b'\\x8e\\x89c\\n'); o.flush(); time.sleep(60)\n")
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
    expected = "".join(f"{i}\n" for i in range(1, 30001)) + "END"
    for n in range(3):
        sid = f"tail{n}"
        assert sh("shell_exec", id=sid, command="seq 1 30000; printf END", block=False) == started(sid)
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
    assert sh("shell_write_to_process", id="py", command="print(1)") == \
        "Error: No active non-blocking session found with ID 'py'."


def test_write_to_bash_read_loop_discards_unviewed_output(sh, container):
    cmd = "echo banner; while read -r line; do echo \"got:$line\"; done"
    assert sh("shell_exec", id="loop", command=cmd, block=False) == started("loop")
    # "banner" is printed but never viewed: the write skips it
    wait_for(container, f"grep -q banner {session_dir('loop')}/out")
    assert settle(sh, "loop", sh("shell_write_to_process", id="loop", command="abc"), "abc\ngot:abc\n") == \
        "abc\ngot:abc\n"
    assert settle(sh, "loop", sh("shell_write_to_process", id="loop", command="d e"), "d e\ngot:d e\n") == \
        "d e\ngot:d e\n"
    assert sh("shell_view", id="loop") == IDLE


def test_write_output_ending_the_process(sh):
    cmd = "read -r x; seq 1 5000; printf done"
    assert sh("shell_exec", id="end", command=cmd, block=False) == started("end")
    expected = "go\n" + "".join(f"{i}\n" for i in range(1, 5001)) + "done"
    assert settle_end(sh, "end", sh("shell_write_to_process", id="end", command="go")) == expected
    assert sh("shell_view", id="end") == TERMINATED_NO_NEW


def test_write_with_no_output(sh):
    assert sh("shell_exec", id="quiet", command="stty -echo; echo ready; cat >/dev/null", block=False) == \
        started("quiet")
    assert sh.view_until("quiet", lambda o: o != IDLE)[-1] == "ready\n"
    assert sh("shell_write_to_process", id="quiet", command="secret") == \
        "Input sent to session 'quiet' successfully (no output)."


def test_write_still_outputting_warning(sh):
    cmd = "read -r x; while true; do echo tick; sleep 0.1; done"
    assert sh("shell_exec", id="chatty", command=cmd, block=False) == started("chatty")
    start = time.monotonic()
    reply = sh("shell_write_to_process", id="chatty", command="go")
    assert 4.9 < time.monotonic() - start < 30
    assert reply.startswith("go\ntick\n") and reply.endswith(WARNING)
    assert set(reply[3:-len(WARNING)].splitlines()) == {"tick"}


def test_write_to_unknown_session(sh):
    assert sh("shell_write_to_process", id="ghost", command="hi") == \
        "Error: No active non-blocking session found with ID 'ghost'."


# ---- shell_write_content_to_file ------------------------------------------------------------
def test_write_relative_absolute_nested(sh, container):
    content = "héllo\n  wörld\n\tno newline at end"
    assert sh("shell_write_content_to_file", content=content, file_path="notes.txt") == \
        "Content successfully written to 'notes.txt' in Docker container."
    assert sh("shell_write_content_to_file", content=content, file_path="deep/er/notes.txt") == \
        "Content successfully written to 'deep/er/notes.txt' in Docker container."
    assert sh("shell_write_content_to_file", content="", file_path="/tmp/a/b/c/empty") == \
        "Content successfully written to '/tmp/a/b/c/empty' in Docker container."
    for path in ["/workspace/notes.txt", "/workspace/deep/er/notes.txt"]:
        assert container.exec_run(["cat", path]).output == content.encode()
    assert container.exec_run(["stat", "-c", "%s %a %U", "/tmp/a/b/c/empty"]).output == b"0 644 root\n"
    assert sh("shell_write_content_to_file", content="v2", file_path="./notes.txt").startswith("Content successfully")
    assert sh("shell_exec", id="t", command="cat notes.txt") == "v2"


def test_write_failures(sh, container):
    container.exec_run(["sh", "-c", "mkdir -p /workspace/dir && touch /workspace/dir/keep"])
    assert sh("shell_write_content_to_file", content="x", file_path="dir") == \
        "Error writing to file 'dir' in Docker container: Is a directory: '/workspace/dir'"
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
    assert sh("shell_exec", id="t") == \
        "[TOOL_ERROR] shell_exec: TypeError: shell_exec() missing 1 required positional argument: 'command'"
    assert sh("shell_view") == \
        "[TOOL_ERROR] shell_view: TypeError: shell_view() missing 1 required positional argument: 'id'"
    assert sh("shell_exec", id="t", command="echo", colour="red") == \
        "[TOOL_ERROR] shell_exec: TypeError: shell_exec() got an unexpected keyword argument 'colour'"
    assert sh("shell_exec", id="t", command="echo", block="false") == \
        "[TOOL_ERROR] shell_exec: TypeError: block must be a boolean or null, not str"
    assert sh("shell_exec", id="t", command="echo", timeout="5") == \
        "[TOOL_ERROR] shell_exec: TypeError: timeout must be a number or null, not str"
    assert sh("shell_exec", id="t", command=["echo"]) == \
        "[TOOL_ERROR] shell_exec: TypeError: command must be a string, not list"
    assert sh("shell_write_content_to_file", content=None, file_path="x") == \
        "[TOOL_ERROR] shell_write_content_to_file: TypeError: content must be a string, not NoneType"
    assert run_tool(sh.container, "shell_view", ["x"], sh.sessions) == \
        "[TOOL_ERROR] shell_view: TypeError: arguments must be an object, not list"
    assert run_tool(sh.container, "shell_view", None, sh.sessions) == \
        "[TOOL_ERROR] shell_view: TypeError: shell_view() missing 1 required positional argument: 'id'"


# ---- state outlives the worker ------------------------------------------------------------
def test_sessions_survive_worker_restart(container, base_image):
    backing = {}
    first = Shell(container, backing)
    assert first("shell_exec", id="keep", command="python3 -q", block=False) == started("keep")
    first.view_until("keep", lambda o: o.endswith(">>> "), timeout=10)
    assert first("shell_exec", id="bg", command="sleep 1; echo late", timeout=0.2) == timed_out(0.2, "bg")
    del first
    # A new worker process: a fresh docker client, a fresh store object over the same data.
    fresh_client = docker.from_env()
    second = Shell(fresh_client.containers.get(container.id), backing)
    expected = "x = 5; print(x + 1)\n6\n>>> "
    assert settle(second, "keep", second("shell_write_to_process", id="keep", command="x = 5; print(x + 1)"),
                  expected) == expected
    seen = second.view_until("bg", lambda o: o != STILL_RUNNING)
    assert seen[-1] == "late\n\n\n--- SESSION COMPLETED ---"
    fresh_client.close()


def test_kill_is_opt_in(container):
    sh = Shell(container, expose_kill=True)
    assert sh("shell_exec", id="k", command="echo up; sleep 61 & sleep 61", block=False) == started("k")
    sh.view_until("k", lambda o: o == "up\n", timeout=5)
    assert sh("shell_kill_process", id="k") == "Process in session 'k' has been terminated."
    assert drain(sh, "k") == ""
    assert sh("shell_kill_process", id="k") == "Session 'k' is not running."
    assert sh("shell_kill_process", id="other") == "Error: No session found with ID 'other'."
    assert "sleep 61" not in processes(container)


# ---- other images and users ---------------------------------------------------------------
def test_non_root_user(client, base_image):
    c = make_container(client, base_image, user="nobody")
    try:
        prepare_container(c)  # named user: one put_archive plus one chown
        sh = Shell(c)
        assert sh("shell_exec", id="t", command="id -un; pwd; touch mine && echo ok") == "nobody\n/workspace\nok\n"
        assert sh("shell_write_content_to_file", content="hi", file_path="a/b.txt").startswith("Content successfully")
        assert sh("shell_exec", id="t", command="stat -c '%U %n' a a/b.txt; echo more >> a/b.txt && cat a/b.txt") == \
            "nobody a\nnobody a/b.txt\nhimore\n"
        assert sh("shell_write_content_to_file", content="x", file_path="/root/x/y.txt") == \
            "Error writing to file '/root/x/y.txt' in Docker container: " \
            "cannot create directory '/root/x': Permission denied"
        assert sh("shell_write_content_to_file", content="x", file_path="a") == \
            "Error writing to file 'a' in Docker container: Is a directory: '/workspace/a'"
        assert sh("shell_exec", id="s", command="id -un", block=False) == started("s")
        assert drain(sh, "s") == "nobody\n"
    finally:
        c.remove(force=True)


def test_numeric_user_and_sh_only_image_unprepared(client, base_image):
    c = make_container(client, base_image, user="1234:1234")
    try:
        c.exec_run(["rm", "-f", "/usr/bin/bash", "/bin/bash"], user="root")
        sh = Shell(c)  # never prepared: the first call installs the helper
        assert sh("shell_write_content_to_file", content="hi", file_path="new/f.txt") == \
            "Content successfully written to 'new/f.txt' in Docker container."
        assert sh("shell_exec", id="t", command="echo from $(id -u); cat new/f.txt") == "from 1234\nhi"
        assert sh("shell_exec", id="t", command="stat -c %u:%g /workspace new new/f.txt") == "1234:1234\n" * 3
        assert sh("shell_exec", id="i", command="read x; echo got $x", block=False) == started("i")
        assert settle_end(sh, "i", sh("shell_write_to_process", id="i", command="it")) == "it\ngot it\n"
    finally:
        c.remove(force=True)


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
