"""shell_write_content_to_file, refused calls, state that outlives the worker, other images and
users, and the run timeout."""

from __future__ import annotations

import time

import docker
import pytest

from environments.session_helper import CTL_SOCKET, HELPER_PATH
from environments.tools import run_tool
from tests.shell_tools.support import (
    MODES,
    STILL_RUNNING,
    Shell,
    bare_model,
    drain,
    make_env,
    processes,
    settle,
    settle_end,
    started,
    timed_out,
    wait_for,
)


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
