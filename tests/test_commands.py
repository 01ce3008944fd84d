"""Commands (POST /v1/runs/<id>/commands, DELETE /v1/jobs/<id>, Run.command) against the real
stack: streams apart, exit statuses as results, cwd, env and user, output caps, time limits and
cancels that leave nothing running, unknown users, refusals that queue nothing, compose runs.
(tests/test_command_units.py tests the parts that need no Docker.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import requests

from poolcore.state import Store
from termpool.client import AsyncPool, AsyncRun, CommandResult, Pool, UnknownUser
from tests.conftest import wait_for
from tests.test_runs_api import assert_error, finished, tool_call

LIMIT = 4 << 20  # COMMAND_OUTPUT_LIMIT's default: the session's stack keeps it


@pytest.fixture(scope="module")
def pool(stack):
    with Pool(stack.url, timeout=60, job_timeout=300, retries=0) as p:
        yield p


@pytest.fixture(scope="module")
def run(pool):
    """One started hello-file run (root by default, WORKDIR /app) for the tests that share it."""
    with pool.start("hello-file") as started:
        yield started


def command(stack, run_id: str, body: dict) -> dict:
    """Queue a command, wait for its job's end: the job record."""
    reply = stack.post(f"/v1/runs/{run_id}/commands", body)
    assert reply.status_code == 202, reply.text
    return finished(stack, reply.json()["job_id"])


def client_container(stack, docker_client, run_id: str):
    return docker_client.containers.get(Store(stack.redis).get_run(run_id)["env"]["client"])


def live_processes(container, text: str) -> list[str]:
    """The container's processes (seen from the host: `docker top`) whose command line holds
    `text`, zombies left out (dead, waiting for their parent to reap them)."""
    listing = container.top(ps_args="-eo pid,stat,args")
    stat, args = listing["Titles"].index("STAT"), listing["Titles"].index("COMMAND")
    return [row[args] for row in listing["Processes"] or [] if text in row[args] and not row[stat].startswith("Z")]


# ---- results -----------------------------------------------------------------------------------
def test_stdout_and_stderr_come_apart_and_a_non_zero_exit_is_a_result(stack, run):
    job = command(stack, run.id, {"command": "echo out; echo err >&2; printf 'é\\xff'; exit 3"})
    assert job["state"] == "succeeded" and job["kind"] == "command" and job["code"] is None, job
    assert job["result"] == {
        "return_code": 3,
        "stdout": "out\né\ufffd",
        "stderr": "err\n",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "timed_out": False,
    }
    assert job["job_id"] in stack.get(f"/v1/runs/{run.id}").json()["run"]["jobs"]
    page = stack.get(f"/ui/runs/{run.id}").text  # the run viewer shows it
    assert "$ echo out; echo err &gt;&amp;2" in page and "exit <b>3</b>" in page


def test_the_client_returns_a_command_result(run):
    assert run.command("echo hi; exit 7") == CommandResult(7, "hi\n", "")
    assert run.command("true") == CommandResult(0, "", "")


def test_cwd_env_and_user_by_name_and_uid_and_the_containers_defaults(run):
    probe = 'pwd; echo "$FOO|$TEST_DIR"; id -un 2>/dev/null || echo -; id -u'
    own = run.command(probe)
    assert own.stdout.splitlines()[0] == "/app" and own.stdout.splitlines()[2:] == ["root", "0"], own
    assert own.stdout.splitlines()[1].startswith("|/"), own  # the container's TEST_DIR: env is merged
    named = run.command(probe, cwd="/tmp", env={"FOO": "a b"}, user="nobody")
    assert named.stdout.splitlines() == ["/tmp", "a b|" + own.stdout.splitlines()[1][1:], "nobody", "65534"], named
    assert run.command("id -u", user=1234).stdout == "1234\n"
    assert run.command("id -u", user="1234").stdout == "1234\n"
    assert run.command("id -u", user="root").stdout == "0\n"


def test_a_container_with_its_own_user_and_working_dir_keeps_them(pool):
    with pool.start("compose-env") as other:  # user 1000:1000, working_dir /work
        result = other.command('pwd; id -u; echo "$GREETING"')
        assert result.stdout.splitlines() == ["/work", "1000", "hello-default"], result
        assert other.command("id -u", user=0).stdout == "0\n"


def test_each_stream_is_cut_at_the_limit_and_flagged(stack, run):
    job = command(stack, run.id, {"command": f"head -c {LIMIT + 1000} /dev/zero | tr '\\0' a; echo small >&2"})
    result = job["result"]
    assert result["stdout_truncated"] is True and len(result["stdout"]) == LIMIT and set(result["stdout"]) == {"a"}
    assert (result["stderr"], result["stderr_truncated"]) == ("small\n", False)


def test_an_unknown_user_fails_the_job_with_its_own_code(stack, run):
    job = command(stack, run.id, {"command": "true", "user": "nosuchuser"})
    assert job["state"] == "failed" and job["code"] == "UNKNOWN_USER" and job["retryable"] is False, job
    assert "nosuchuser" in job["error"]
    with pytest.raises(UnknownUser, match="nosuchuser"):
        run.command("true", user="nosuchuser")


# ---- time limits and cancels --------------------------------------------------------------------
GROUP = "sleep 1001 & sleep 1001 & setsid sleep 1001 & echo started; wait"


def test_a_time_limit_kills_everything_the_command_started(stack, docker_client, run):
    container = client_container(stack, docker_client, run.id)
    began = time.monotonic()
    job = command(stack, run.id, {"command": GROUP, "timeout_sec": 2})
    assert job["state"] == "succeeded", job
    assert job["result"]["timed_out"] is True and job["result"]["return_code"] == 124, job
    assert job["result"]["stdout"] == "started\n"
    assert time.monotonic() - began < 20
    assert live_processes(container, "sleep 1001") == []
    assert run.command("echo still usable").stdout == "still usable\n"


def test_a_cancelled_await_kills_the_command_and_fails_its_job(stack, docker_client, run):
    container = client_container(stack, docker_client, run.id)

    async def abandon() -> None:
        async with AsyncPool(stack.url, retries=0) as apool:
            waiting = asyncio.ensure_future(AsyncRun(apool, run.id).command(GROUP.replace("1001", "1002")))
            await asyncio.sleep(3)
            assert live_processes(container, "sleep 1002"), "the command did not start"
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

    asyncio.run(abandon())
    job_id = run.info()["jobs"][-1]
    job = finished(stack, job_id, 30)
    assert job["kind"] == "command" and job["state"] == "failed", job
    assert (job["code"], job["retryable"]) == ("JOB_CANCELLED", False), job
    assert wait_for(lambda: live_processes(container, "sleep 1002") == [], 10), live_processes(container, "sleep")


def test_delete_of_ended_other_and_unknown_jobs(stack, run):
    ended = command(stack, run.id, {"command": "true"})
    reply = requests.delete(f"{stack.url}/v1/jobs/{ended['job_id']}", timeout=30)
    assert reply.status_code == 200 and reply.json() == {
        "ok": True,
        "job_id": ended["job_id"],
        "cancelled": False,
        "state": "succeeded",
    }
    tool_job = tool_call(stack, run.id, "shell_view", id="main")
    reply = requests.delete(f"{stack.url}/v1/jobs/{tool_job}", timeout=30)
    assert_error(reply, 409, "only command jobs", "JOB_NOT_CANCELLABLE")
    reply = requests.delete(f"{stack.url}/v1/jobs/00000000-0000-0000-0000-000000000000", timeout=30)
    assert_error(reply, 404, "unknown job", "UNKNOWN_JOB")


def test_delete_of_a_running_command_answers_202_and_the_job_fails_cancelled(stack, docker_client, run):
    container = client_container(stack, docker_client, run.id)
    reply = stack.post(f"/v1/runs/{run.id}/commands", {"command": GROUP.replace("1001", "1003")})
    job_id = reply.json()["job_id"]
    assert wait_for(lambda: live_processes(container, "sleep 1003"), 20)
    reply = requests.delete(f"{stack.url}/v1/jobs/{job_id}", timeout=30)
    assert reply.status_code == 202 and reply.json() == {"ok": True, "job_id": job_id, "cancelled": True}
    job = finished(stack, job_id, 30)
    assert (job["state"], job["code"]) == ("failed", "JOB_CANCELLED"), job
    assert live_processes(container, "sleep 1003") == []


def test_a_long_command_does_not_hold_up_the_runs_tool_calls(stack, run):
    reply = stack.post(f"/v1/runs/{run.id}/commands", {"command": "sleep 6"})
    long_job = reply.json()["job_id"]
    began = time.monotonic()
    quick = finished(stack, tool_call(stack, run.id, "shell_exec", id="side", command="echo quick", block=True))
    assert "quick" in quick["result"] and time.monotonic() - began < 4, quick
    assert finished(stack, long_job)["result"]["return_code"] == 0


# ---- refusals -----------------------------------------------------------------------------------
def test_bad_requests_are_400_and_queue_nothing(stack, run):
    before = run.info()["jobs"]
    for body, text in [
        ({"command": "ls", "cwd": "relative"}, "cwd must be an absolute path"),
        ({"command": "ls", "env": {"A": 1}}, "env.A must be a string"),
        ({"command": "x" * 200_000}, "command is longer than"),
        ({"command": "ls", "env": {"A": "v" * 200_000}}, "NAME=VALUE is longer"),
        ({"command": "ls", "timeout_sec": -1}, "timeout_sec"),
        ({"command": "ls", "user": "two words"}, "user must be"),
        ({}, "command is required"),
    ]:
        assert_error(stack.post(f"/v1/runs/{run.id}/commands", body), 400, text, "BAD_REQUEST")
    assert run.info()["jobs"] == before
    assert_error(stack.post("/v1/runs/run-0000000000000000/commands", {"command": "ls"}), 404, "", "UNKNOWN_RUN")


# ---- compose runs -------------------------------------------------------------------------------
def test_commands_run_in_a_compose_runs_agent_container(stack, docker_client, pool):
    with pool.start("two-service-small") as compose_run:
        container = client_container(stack, docker_client, compose_run.id)
        result = compose_run.command("cat /etc/hostname; getent hosts side >/dev/null && echo side-reachable")
        assert result.return_code == 0 and result.stdout.splitlines()[1] == "side-reachable", result
        assert result.stdout.splitlines()[0] == container.attrs["Config"]["Hostname"]
        timed = compose_run.command(GROUP.replace("1001", "1004"), timeout_sec=1.5)
        assert timed.timed_out and timed.return_code == 124 and timed.stdout == "started\n", timed
        assert live_processes(container, "sleep 1004") == []
    run_id = compose_run.id
    reply = stack.post(f"/v1/runs/{run_id}/commands", {"command": "ls"})
    assert_error(reply, 409, "", "RUN_CLOSED")
