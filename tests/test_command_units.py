"""Commands without Docker: the exec stream's frames, output caps, the wait's time limit and
cancel against a fake Engine API on a socket pair, the kill script against real processes on
this machine, request validation, and the client's cancel of an abandoned command
(tests/test_commands.py runs them for real)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid

import httpx
import pytest
from pydantic import ValidationError

from app.command_models import MAX_ARG_BYTES, CommandRequest
from app.fields import explain
from environments import commands
from poolcore import failures
from poolcore.config import load_settings
from tasks.command_jobs import command_spec
from termpool.client import AsyncPool, AsyncRun, CommandResult, Pool, Run, WaitTimeout
from tests.conftest import make_app, wait_for

pytestmark = pytest.mark.unit


def frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(payload)) + payload


# ---- the stream ---------------------------------------------------------------------------------
def test_frames_split_anywhere_come_out_whole_and_apart():
    data = frame(1, b"out one\n") + frame(2, b"err\n") + frame(1, b"") + frame(1, "é".encode())
    for cut in range(len(data) + 1):
        reader = commands.FrameReader()
        frames = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert frames == [(1, b"out one\n"), (2, b"err\n"), (1, b""), (1, "é".encode())], cut


def test_a_capped_buffer_keeps_the_head_and_says_it_was_cut():
    buffer = commands.CappedBuffer(5)
    buffer.add(b"abc")
    assert not buffer.truncated
    buffer.add(b"def")
    buffer.add(b"ghi")
    assert buffer.data == b"abcde" and buffer.truncated
    exact = commands.CappedBuffer(3)
    exact.add(b"abc")
    assert not exact.truncated
    cut_char = commands.CappedBuffer(1)
    cut_char.add("é".encode())  # two bytes: the first alone is not UTF-8
    assert cut_char.text() == "\ufffd"


# ---- the wait, against a fake Engine API --------------------------------------------------------
class FakeApi:
    """The four calls commands.run makes; the exec's output is what the test writes into
    `feed`, the other end of a socket pair."""

    def __init__(self, exit_code: int = 0, never_started: bool = False):
        self.ours, self.feed = socket.socketpair()
        self.exit_code, self.never_started = exit_code, never_started
        self.running = True
        self.created: list[dict] = []
        self.kills: list[dict] = []

    def exec_create(self, container, cmd, **options):
        if cmd[:2] == ["sh", "-c"]:
            self.kills.append({"container": container, "cmd": cmd, **options})
            self.running = False
            self.feed.close()  # everything the command started is gone: so is its output
            return {"Id": "kill"}
        self.created.append({"container": container, "cmd": cmd, **options})
        return {"Id": "cmd"}

    def exec_start(self, exec_id, demux=False):  # the kill's
        return None, None

    def exec_inspect(self, exec_id):
        code = 126 if self.never_started else self.exit_code
        return {
            "Running": self.running,
            "ExitCode": None if self.running else code,
            "Pid": 0 if self.never_started else 7,
        }

    def finish(self, *chunks: bytes) -> None:
        for chunk in chunks:
            self.feed.sendall(chunk)
        self.running = False
        self.feed.close()


@pytest.fixture(autouse=True)
def fake_stream(monkeypatch):
    """The exec's stream is the FakeApi's socket pair (the real one: test_the_stream_starts_...)."""
    monkeypatch.setattr(commands, "open_exec_stream", lambda api, exec_id: (api.ours, b""))


def spec(**extra) -> commands.Command:
    return commands.Command(command="true", marker="job-1", **extra)


def test_a_command_that_ends_gives_its_streams_apart_and_its_exit_status():
    api = FakeApi(exit_code=3)
    api.finish(frame(1, b"to stdout\n"), frame(2, b"to stderr\n"), frame(1, b"\xff more"))
    result = commands.run(api, "box", spec(cwd="/tmp", env={"A": "1"}, user="1000"), 1 << 20, lambda: False)
    assert result == {
        "return_code": 3,
        "stdout": "to stdout\n\ufffd more",
        "stderr": "to stderr\n",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "timed_out": False,
    }
    created = api.created[0]
    assert created["cmd"] == ["bash", "-c", "true"] and created["workdir"] == "/tmp" and created["user"] == "1000"
    assert created["environment"] == {"A": "1", commands.MARKER_VAR: "job-1"}
    assert not api.kills


def test_output_past_the_limit_is_cut_and_flagged_per_stream():
    api = FakeApi()
    api.finish(frame(1, b"x" * 10), frame(2, b"y" * 4))
    result = commands.run(api, "box", spec(), 6, lambda: False)
    assert (result["stdout"], result["stdout_truncated"]) == ("xxxxxx", True)
    assert (result["stderr"], result["stderr_truncated"]) == ("yyyy", False)


def test_a_command_past_its_time_limit_is_killed_and_answers_124_with_its_output_so_far():
    api = FakeApi(exit_code=137)
    api.feed.sendall(frame(1, b"started\n"))
    began = time.monotonic()
    result = commands.run(api, "box", spec(timeout_sec=0.5, user="alice"), 1 << 20, lambda: False)
    assert 0.5 <= time.monotonic() - began < 3
    assert result["timed_out"] and result["return_code"] == commands.TIMED_OUT_CODE
    assert result["stdout"] == "started\n"
    kill = api.kills[0]
    assert kill["cmd"][-1] == "job-1" and kill["user"] == "alice" and kill["container"] == "box"


def test_a_cancel_kills_the_command_and_raises():
    api = FakeApi()
    asked = threading.Event()
    threading.Timer(0.3, asked.set).start()
    with pytest.raises(commands.Cancelled, match="cancelled by its client"):
        commands.run(api, "box", spec(), 1 << 20, asked.is_set)
    assert len(api.kills) == 1


def test_a_process_left_holding_the_output_does_not_hold_the_result(monkeypatch):
    monkeypatch.setattr(commands, "EXITED_CHECK_SECONDS", 0.2)
    monkeypatch.setattr(commands, "DRAIN_SECONDS", 0.3)
    api = FakeApi(exit_code=0)
    api.feed.sendall(frame(1, b"served\n"))
    api.running = False  # its own process ended; the stream stays open (a server left running)
    began = time.monotonic()
    result = commands.run(api, "box", spec(), 1 << 20, lambda: False)
    assert time.monotonic() - began < 3
    assert result["stdout"] == "served\n" and not result["timed_out"] and not api.kills


def test_an_exec_docker_could_not_start_for_its_user_is_unknown_user():
    api = FakeApi(never_started=True)
    api.finish(frame(1, b"unable to find user nobody2: no matching entries in passwd file\r\n"))
    with pytest.raises(commands.UnknownUser, match="'nobody2'"):
        commands.run(api, "box", spec(user="nobody2"), 1 << 20, lambda: False)


def test_an_exec_docker_could_not_start_for_another_reason_is_a_result_on_stderr():
    api = FakeApi(never_started=True)
    api.finish(frame(1, b'OCI runtime exec failed: chdir to cwd ("/nope"): no such file or directory\r\n'))
    result = commands.run(api, "box", spec(cwd="/nope"), 1 << 20, lambda: False)
    assert result["return_code"] == 126 and result["stdout"] == "" and "/nope" in result["stderr"]


def test_the_stream_starts_with_the_bytes_that_came_with_the_replys_head(monkeypatch):
    """Docker's refusal of an exec comes in the same read as the reply's head: it is kept."""
    monkeypatch.undo()  # the real open_exec_stream
    ours, engine = socket.socketpair()
    monkeypatch.setattr(commands, "connect_engine", lambda api: ours)
    refusal = frame(1, b"unable to find user x\r\n")

    def answer():
        request = engine.recv(65536)
        assert request.startswith(b"POST /v1.41/exec/abc/start HTTP/1.1\r\n") and b"Upgrade: tcp" in request
        engine.sendall(b"HTTP/1.1 101 UPGRADED\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n" + refusal)

    threading.Thread(target=answer).start()
    conn, first = commands.open_exec_stream(type("Api", (), {"api_version": "1.41"})(), "abc")
    assert conn is ours and first == refusal


def test_a_refused_exec_start_is_a_docker_error(monkeypatch):
    monkeypatch.undo()
    ours, engine = socket.socketpair()
    monkeypatch.setattr(commands, "connect_engine", lambda api: ours)
    engine.sendall(b'HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\n\r\n{"message": "not running"}')
    with pytest.raises(failures.DockerError, match="409 Conflict"):
        commands.open_exec_stream(type("Api", (), {"api_version": "1.41"})(), "abc")


# ---- the kill script, on this machine's processes --------------------------------------------
def test_the_kill_script_kills_every_marked_process_and_the_groups_they_lead():
    marker = f"{commands.MARKER_VAR}=test-{uuid.uuid4()}"
    name, value = marker.split("=", 1)
    unmarked = f"sleep {900000 + uuid.uuid4().int % 99999}"  # cleared its environment, stayed in the group
    # A group of its own with background children: one leaves the group (setsid), one has no marker.
    tree = subprocess.Popen(
        ["setsid", "bash", "-c", f"sleep 1000 & setsid sleep 999 & env -i {unmarked} & wait"],
        env={"PATH": "/usr/bin:/bin", name: value},
    )
    try:
        assert _wait_for_marked(marker, 3), _marked(marker)
        assert wait_for(lambda: _pids_of(unmarked), 10)
        done = subprocess.run(["sh", "-c", commands.KILL_SCRIPT, "kill-command", marker], timeout=30)
        assert done.returncode == 0
        tree.wait(timeout=10)
        assert _marked(marker) == []
        assert wait_for(lambda: not _pids_of(unmarked), 5), _pids_of(unmarked)
    finally:
        tree.kill()
        for pid in _pids_of(unmarked) + _marked(marker):  # what a failure left, by pid
            os.kill(int(pid), signal.SIGKILL)


def _pids_of(command_line: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"^{command_line}$"], capture_output=True, text=True)
    return [pid for pid in found.stdout.split() if _state(pid) not in ("Z", None)]


def _marked(marker: str) -> list[str]:
    """Live (not zombie) processes whose environment holds the marker."""
    found = subprocess.run(["sh", "-c", 'grep -lsF -- "$1" /proc/[0-9]*/environ', "-", marker], capture_output=True)
    pids = [line.split("/")[2] for line in found.stdout.decode().split()]
    return [pid for pid in pids if _state(pid) not in ("Z", None)]


def _state(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _wait_for_marked(marker: str, count: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len(_marked(marker)) >= count:
            return True
        time.sleep(0.05)
    return False


# ---- the request --------------------------------------------------------------------------------
CFG = load_settings({"COMMAND_MAX_TIMEOUT": "600"})


def refusal(body: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        CommandRequest.model_validate(body, context={"cfg": CFG})
    return explain(caught.value)


def test_requests_are_checked_before_anything_is_queued():
    assert refusal({"command": "ls", "cwd": "tmp"}) == "cwd must be an absolute path"
    assert refusal({"command": "ls", "env": {"A": 1}}) == "env.A must be a string"
    assert refusal({"command": "ls", "env": {"A=B": "c"}}).startswith("env has a bad name")
    assert refusal({"command": "x" * (MAX_ARG_BYTES + 1)}).startswith("command is longer than")
    assert refusal({"command": "ls\x00"}) == "command must not contain a NUL character"
    assert refusal({"command": "ls", "env": {"BIG": "v" * MAX_ARG_BYTES}}).startswith("env BIG: NAME=VALUE is longer")
    assert refusal({"command": "ls", "timeout_sec": 0}).startswith("timeout_sec")
    assert refusal({"command": "ls", "timeout_sec": "5"}) == "timeout_sec must be a number of seconds"
    assert refusal({"command": "ls", "user": "a b"}).startswith("user must be a user name")
    assert refusal({"command": "ls", "user": -1}).startswith("user must be a uid")
    assert refusal({"command": "ls", "user": True}).startswith("user must be a user name or a uid")
    assert refusal({}) == "command is required"


def test_a_valid_request_keeps_its_values_and_a_uid_becomes_digits():
    body = {"command": "ls", "cwd": "/app", "env": {"A": "1"}, "user": 1000, "timeout_sec": 2.5}
    model = CommandRequest.model_validate(body, context={"cfg": CFG})
    assert model.model_dump() == {**body, "user": "1000"}
    assert CommandRequest.model_validate({"command": "ls"}, context={"cfg": CFG}).user is None
    assert CommandRequest.model_validate({"command": "ls", "user": 393.0}, context={"cfg": CFG}).user == "393"
    assert refusal({"command": "ls", "user": 3.5}).startswith("user must be a user name or a uid")


def test_a_command_without_a_time_limit_or_past_the_bound_gets_the_bound():
    assert command_spec({"command": "ls"}, "m", 600.0).timeout_sec == 600.0
    assert command_spec({"command": "ls", "timeout_sec": 1e9}, "m", 600.0).timeout_sec == 600.0
    assert command_spec({"command": "ls", "timeout_sec": 5}, "m", 600.0).timeout_sec == 5.0


# ---- the client ---------------------------------------------------------------------------------
JOB = "11111111-2222-3333-4444-555555555555"


def fake_service(seen: list, job: dict | None = None):
    """POST answers a job id; GET the job (`job`, or still running); DELETE is recorded."""

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, json.loads(request.content or b"null")))
        if request.method == "POST":
            return httpx.Response(202, json={"ok": True, "job_id": JOB})
        if request.method == "DELETE":
            return httpx.Response(202, json={"ok": True, "job_id": JOB, "cancelled": True})
        return httpx.Response(200, json={"ok": True, "job": job or {"job_id": JOB, "state": "running"}})

    return answer


def test_the_blocking_client_returns_a_command_result():
    seen: list = []
    result = {"return_code": 2, "stdout": "o", "stderr": "e", "stdout_truncated": True}
    job = {"job_id": JOB, "kind": "command", "state": "succeeded", "result": {**result, "stderr_truncated": False}}
    with Pool("http://termpool.test", retries=0) as pool:
        pool._http = httpx.Client(base_url=pool.url, transport=httpx.MockTransport(fake_service(seen, job)))
        got = Run(pool, "run-0123456789abcdef").command("exit 2", cwd="/app", env={"A": "1"}, user=0, timeout_sec=9)
    assert got == CommandResult(2, "o", "e", stdout_truncated=True)
    body = {"command": "exit 2", "cwd": "/app", "env": {"A": "1"}, "user": 0, "timeout_sec": 9}
    assert seen[0] == ("POST", "/v1/runs/run-0123456789abcdef/commands", body)
    assert [method for method, _, _ in seen] == ["POST", "GET"]


def test_a_cancelled_await_cancels_the_command_then_goes_on():
    seen: list = []

    async def wait_forever(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            await asyncio.sleep(3600)
        return fake_service(seen)(request)

    async def main():
        async with AsyncPool("http://termpool.test", retries=0) as pool:
            pool._http = httpx.AsyncClient(base_url=pool.url, transport=httpx.MockTransport(wait_forever))
            command = asyncio.ensure_future(AsyncRun(pool, "run-0123456789abcdef").command("sleep 1000"))
            await asyncio.sleep(0.2)
            command.cancel()
            with pytest.raises(asyncio.CancelledError):
                await command
        return seen

    seen = asyncio.run(main())
    assert [(method, path) for method, path, _ in seen] == [
        ("POST", "/v1/runs/run-0123456789abcdef/commands"),
        ("DELETE", f"/v1/jobs/{JOB}"),
    ]


def test_what_flower_shows_of_a_command_names_its_env_but_not_the_values():
    from poolcore import dispatch
    from poolcore.queues import make_celery

    celery = make_celery(CFG)  # a signature is only made, never sent
    command = {"command": "ls", "env": {"API_KEY": "secret-value"}, "cwd": None, "user": None, "timeout_sec": None}
    signature = dispatch.job_signature(
        celery,
        "pool.run_command",
        {"command": dispatch.recorded_command(command)},
        host="h",
        run_id="r",
        command=command,
    )
    shown = signature.options["kwargsrepr"]
    assert "API_KEY" in shown and "secret-value" not in shown
    assert signature.kwargs["command"]["env"] == {"API_KEY": "secret-value"}  # the worker gets the values


def test_ctrl_c_in_a_blocking_command_cancels_it_then_goes_on():
    seen: list = []

    def interrupted(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            raise KeyboardInterrupt
        return fake_service(seen)(request)

    with Pool("http://termpool.test", retries=0) as pool:
        pool._http = httpx.Client(base_url=pool.url, transport=httpx.MockTransport(interrupted))
        with pytest.raises(KeyboardInterrupt):
            Run(pool, "run-0123456789abcdef").command("sleep 1000")
    assert [method for method, _, _ in seen] == ["POST", "DELETE"]


def test_a_wait_past_the_job_timeout_cancels_the_command():
    seen: list = []
    with Pool("http://termpool.test", retries=0, job_timeout=0.5) as pool:
        pool._http = httpx.Client(base_url=pool.url, transport=httpx.MockTransport(fake_service(seen)))
        with pytest.raises(WaitTimeout):
            Run(pool, "run-0123456789abcdef").command("sleep 1000")
    assert seen[-1][:2] == ("DELETE", f"/v1/jobs/{JOB}")


# ---- cancels, on the facade over a bare redis-server -----------------------------------------
@pytest.fixture
def facade(redis_server, tmp_path):
    from poolcore.state import Store

    redis_server.flushdb()
    port = redis_server.connection_pool.connection_kwargs["port"]
    settings = {"REDIS_URL": f"redis://127.0.0.1:{port}/0", "POOL_HOST_ID": "unit", "DATASET_DIR": str(tmp_path)}
    return make_app({**settings, "TBENCH_OUTPUT_ROOT": str(tmp_path / "out")}).test_client(), Store(redis_server)


def test_delete_ends_a_queued_command_at_once_and_marks_a_running_one(facade):
    client, store = facade
    run_id, queued, running = "run-0123456789abcdef", str(uuid.uuid4()), str(uuid.uuid4())
    store.create_job(queued, run_id, "command")
    reply = client.delete(f"/v1/jobs/{queued}")
    assert (reply.status_code, reply.get_json()) == (202, {"ok": True, "job_id": queued, "cancelled": True})
    job = store.get_job(queued)
    assert (job["state"], job["code"], job["retryable"]) == ("failed", "JOB_CANCELLED", False)
    again = client.delete(f"/v1/jobs/{queued}")
    assert again.status_code == 200
    assert again.get_json() == {"ok": True, "job_id": queued, "cancelled": False, "state": "failed"}

    store.create_job(running, run_id, "command")
    store.begin_job(running, "exec-node@unit", "token")
    assert not store.cancel_requested(running)
    assert client.delete(f"/v1/jobs/{running}").status_code == 202
    assert store.get_job(running)["state"] == "running" and store.cancel_requested(running)  # its worker ends it


def test_delete_refuses_other_kinds_and_unknown_jobs(facade):
    client, store = facade
    tool_job = str(uuid.uuid4())
    store.create_job(tool_job, "run-0123456789abcdef", "tool_call")
    reply = client.delete(f"/v1/jobs/{tool_job}")
    assert reply.status_code == 409 and reply.get_json()["code"] == "JOB_NOT_CANCELLABLE"
    assert store.get_job(tool_job)["state"] == "queued" and not store.cancel_requested(tool_job)
    reply = client.delete(f"/v1/jobs/{uuid.uuid4()}")
    assert reply.status_code == 404 and reply.get_json()["code"] == "UNKNOWN_JOB"
