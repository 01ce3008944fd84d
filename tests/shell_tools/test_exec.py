"""The tools' schemas and blocking shell_exec, in both transports."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from environments.tools import schemas, tool_schemas
from tests.shell_tools.support import (
    NO_OUTPUT,
    SCHEMAS_SHA256,
    STILL_RUNNING,
    TERMINATED_NO_NEW,
    drain,
    settle,
    started,
    timed_out,
)


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
