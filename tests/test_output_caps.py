"""Output is bounded: a session's file on disk (SESSION_OUTPUT_LIMIT), one observation
(OBSERVATION_LIMIT) and one tool call's record in tool_calls.jsonl."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from devstack import ROOT
from environments import artifacts
from environments.session_helper import HELPER_PATH, prepare_container, session_dir
from environments.tools import OutputLimits, cap_text, run_tool
from tests.conftest import Router, private_stack, wait_for

SESSION_LIMIT = 1 << 20
OBSERVATION_LIMIT = 8192
NOTE = "[... "
OLD_HELPER_COMMIT = "e1c90f7"  # the helper before output limits
OLD_HELPER_SOURCE = "tasks/helper/tp_session.c"  # its path then (environments/helper/ since the layout change)


# ---- pure logic -------------------------------------------------------------------------------
@pytest.mark.unit
def test_short_text_is_unchanged():
    assert cap_text("Command executed successfully (no output).", 100) == "Command executed successfully (no output)."


@pytest.mark.unit
def test_long_text_keeps_its_newest_part_behind_a_note():
    text = "".join(f"{i}\n" for i in range(100000))
    capped = cap_text(text, 4096)
    assert len(capped) <= 4096
    assert capped.startswith(NOTE) and "characters of output not shown (output limit)" in capped
    assert capped.endswith("99998\n99999\n")


@pytest.mark.unit
def test_tool_call_record_is_bounded(tmp_path):
    call = {"name": "shell_write_content_to_file", "arguments": {"content": "x" * 500_000, "file_path": "a"}}
    artifacts.log_tool_call(tmp_path, call, "y" * 300_000, 0.1, limit=OBSERVATION_LIMIT)
    line = (tmp_path / artifacts.TOOL_LOG).read_text()
    assert len(line) < 3 * OBSERVATION_LIMIT
    record = json.loads(line)
    assert record["tool_call"]["arguments"]["file_path"] == "a"
    assert record["tool_call"]["arguments"]["content"].startswith(NOTE)


# ---- against a real stack ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def capped_stack(base_image, docker_client):
    yield from private_stack(
        docker_client, {"SESSION_OUTPUT_LIMIT": str(SESSION_LIMIT), "OBSERVATION_LIMIT": str(OBSERVATION_LIMIT)}
    )


@pytest.fixture
def lease(capped_stack, docker_client):
    router = Router(capped_stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200, "reset failed"
    yield lease
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60), "teardown did not finish"


def _client(stack, docker_client, lease):
    [container] = Router(stack).run_containers(docker_client, lease)  # hello-file: one container
    return container


def _session_disk(container, sid: str) -> tuple[int, int]:
    """(bytes on disk, apparent size) of the session's output file."""
    out = container.exec_run(["stat", "-c", "%b %B %s", f"{session_dir(sid)}/out"]).output.decode().split()
    return int(out[0]) * int(out[1]), int(out[2])


def _du(path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def test_endless_session_output_stays_within_the_caps(capped_stack, lease, docker_client):
    router = Router(capped_stack)
    before = _du(capped_stack.output_root)
    assert router.tool(lease, "shell_exec", id="flood", command="yes", block=False).startswith("Session 'flood'")
    container = _client(capped_stack, docker_client, lease)
    # Well past the limit: the file's apparent size grows, its blocks on disk do not.
    assert wait_for(lambda: _session_disk(container, "flood")[1] > 4 * SESSION_LIMIT, 120, 0.5), (
        "yes did not produce output"
    )
    disk, size = _session_disk(container, "flood")
    assert disk <= SESSION_LIMIT + (256 << 10), (disk, size)
    view = router.tool(lease, "shell_view", id="flood")
    assert len(view) <= OBSERVATION_LIMIT and view.startswith(NOTE), view[:200]
    assert view.rstrip("y\n").endswith("bytes of output not shown (output limit) ...]"), view[:200]
    again = router.tool(lease, "shell_view", id="flood")
    assert len(again) <= OBSERVATION_LIMIT
    # Two huge observations and a session far past its limit added little to the run's folder.
    assert _du(capped_stack.output_root) - before < 8 * OBSERVATION_LIMIT


def test_blocking_output_is_capped(capped_stack, lease):
    text = Router(capped_stack).tool(lease, "shell_exec", id="b", command="seq 1 300000", block=True, timeout=60)
    assert len(text) <= OBSERVATION_LIMIT and text.startswith(NOTE)
    assert text.endswith("\n299999\n300000\n")


def test_timed_out_blocking_command_is_capped_too(capped_stack, lease, docker_client):
    router = Router(capped_stack)
    reply = router.tool(lease, "shell_exec", id="bg", command="yes", block=True, timeout=1)
    assert reply.startswith("Command did not complete within 1 seconds")
    container = _client(capped_stack, docker_client, lease)
    assert wait_for(lambda: _session_disk(container, "bg")[1] > 4 * SESSION_LIMIT, 120, 0.5)
    assert _session_disk(container, "bg")[0] <= SESSION_LIMIT + (256 << 10)


def test_background_job_may_write_after_a_blocking_call(capped_stack, lease):
    """Output goes through a pipe the helper copies; a job the command left in the background
    keeps it open and writes later without dying of SIGPIPE."""
    router = Router(capped_stack)
    cmd = "(sleep 1; echo late; sleep 1; touch /tmp/alive) >/dev/stdout 2>&1 & echo started"
    assert router.tool(lease, "shell_exec", id="j", command=cmd, block=True, timeout=30) == "started\n"
    alive = "ls /tmp/alive 2>/dev/null || true"
    assert wait_for(
        lambda: router.tool(lease, "shell_exec", id="j", command=alive, block=True, timeout=30) == "/tmp/alive\n", 30
    )


class MemorySessions(dict):
    """run_tool's session store, in memory."""

    def set(self, sid, **fields):
        self.setdefault(sid, {}).update(fields)


def test_a_helper_from_before_the_limits_is_replaced(base_image, docker_client, tmp_path):
    """A container prepared by an older termpool (a run that outlived an upgrade of its workers)
    has a helper that does not know --limit: the first call installs the current one."""
    source = subprocess.run(
        ["git", "show", f"{OLD_HELPER_COMMIT}:{OLD_HELPER_SOURCE}"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    (tmp_path / "tp_session.c").write_bytes(source)
    subprocess.run(
        ["gcc", "-O2", "-static", "-o", str(tmp_path / "tp-session"), str(tmp_path / "tp_session.c"), "-lutil"],
        check=True,
        capture_output=True,
    )
    container = docker_client.containers.run(base_image, ["sleep", "infinity"], detach=True)
    try:
        prepare_container(container)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(tmp_path / "tp-session", arcname=HELPER_PATH.lstrip("/"))
        assert container.put_archive("/", archive.getvalue())
        limits = OutputLimits(SESSION_LIMIT, OBSERVATION_LIMIT)
        reply = run_tool(container, "shell_exec", {"id": "a", "command": "echo hi"}, MemorySessions(), limits=limits)
        assert reply == "hi\n"
    finally:
        container.remove(force=True)
