"""The tp-session server (socket mode): shared with docker exec, its refusals, its restarts."""

from __future__ import annotations

import hashlib
import io
import posixpath
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from unittest import mock

import pytest

from environments.session_helper import CTL_SOCKET, HELPER_PATH, SESSIONS_ROOT, prepare_container
from environments.tools import server_socket, transport
from tests.shell_tools.support import (
    ROOT,
    STILL_RUNNING,
    drain,
    make_env,
    proc_table,
    processes,
    raw_request,
    server_pid,
    settle_end,
    started,
    timed_out,
    wait_for,
    wait_for_server,
)


# ---- the tp-session server (socket mode) ----------------------------------------------------
@pytest.fixture(scope="module")
def served(client, base_image, tmp_path_factory):
    """A container of its own with a running server, for the tests that break it on purpose."""
    e = make_env(client, base_image, "socket", tmp_path_factory)
    try:
        yield e
    finally:
        e.remove()


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
