"""Non-blocking shell sessions and shell_write_to_process, in both transports."""

from __future__ import annotations

import time

import pytest

from environments.session_helper import SESSIONS_ROOT, session_dir
from tests.shell_tools.support import (
    IDLE,
    TERMINATED_NO_NEW,
    WARNING,
    drain,
    settle,
    settle_end,
    started,
    wait_for,
)


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
