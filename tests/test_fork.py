"""Forking a live run (POST /v1/runs/<id>/fork, POST /fork): children of a one-service, a compose
and a Harbor task carry the parent's files and sessions, live independent futures, evaluate on
their own and outlive their parent; forks of forks; committed images go with the last run that
needs them; bad input and a Docker fault leave nothing behind. The session's real stack
(tests/conftest.py) over HTTP."""

from __future__ import annotations

import os

import pytest
import requests

from environments import forking
from environments.session_helper import session_dir
from poolcore.config import load_settings
from poolcore.queues import make_celery
from poolcore.state import Store
from tests.conftest import private_stack, run_containers, wait_for
from tests.test_harbor_tasks import STACK_ENV, harbor_close, harbor_reset, harbor_sh, harbor_solve
from tests.test_runs_api import (
    assert_error,
    delete,
    finished,
    get_run,
    solution_script,
    submit,
    tool_call,
)


# ---- helpers --------------------------------------------------------------------------------
def started(stack, task: str) -> str:
    body = submit(stack, task)
    job = finished(stack, body["job_id"])
    assert job["state"] == "succeeded", job
    return body["run_id"]


def sh(stack, run_id: str, command: str, sid: str = "main") -> str:
    job = finished(stack, tool_call(stack, run_id, "shell_exec", id=sid, command=command, block=True, timeout=30))
    assert job["state"] == "succeeded", job
    return job["result"]


def call(stack, run_id: str, name: str, **arguments) -> str:
    job = finished(stack, tool_call(stack, run_id, name, **arguments))
    assert job["state"] == "succeeded", job
    return job["result"]


def fork(stack, run_id: str, count: int) -> tuple[dict, list[str]]:
    reply = stack.post(f"/v1/runs/{run_id}/fork", {"count": count})
    assert reply.status_code == 202, reply.text
    body = reply.json()
    assert len(body["run_ids"]) == count and len(set(body["run_ids"])) == count, body
    return finished(stack, body["job_id"]), body["run_ids"]


def evaluate(stack, run_id: str) -> float:
    reply = stack.post(f"/v1/runs/{run_id}/evaluation")
    assert reply.status_code == 202, reply.text
    job = finished(stack, reply.json()["job_id"])
    assert job["state"] == "succeeded", job
    return job["result"]["score"]


def close_all(stack, docker_client, *run_ids: str) -> None:
    for run_id in run_ids:
        delete(stack, run_id)
    store = Store.from_url(stack.env["REDIS_URL"])
    for run_id in run_ids:
        assert wait_for(lambda r=run_id: get_run(stack, r)["state"] == "closed", 60), run_id
        assert not run_containers(docker_client, store, run_id), f"teardown of {run_id} left containers"


def fork_images(docker_client, stack, source: str) -> list[str]:
    # The listing's own records: images.list() inspects each image after listing, and a fork
    # image the teardown removes in between would fail it (ImageNotFound).
    found = docker_client.api.images(filters={"label": f"{forking.FORK_HOST_LABEL}={stack.host_id}"})
    tags = [tag for image in found for tag in image.get("RepoTags") or []]
    return [tag for tag in tags if tag.startswith(f"{forking.FORK_REPOSITORY}:{source}-")]


def start_shell(stack, run_id: str, sid: str, cwd: str) -> None:
    """An interactive session whose shell has FORKED_VAR in its environment and sits in `cwd`."""
    assert "started" in call(stack, run_id, "shell_exec", id=sid, command="env FORKED_VAR=carried bash", block=False)
    call(stack, run_id, "shell_write_to_process", id=sid, command=f"mkdir -p {cwd} && cd {cwd}")


def shell_says(stack, run_id: str, sid: str, command: str) -> str:
    return call(stack, run_id, "shell_write_to_process", id=sid, command=command)


# ---- one-service task -----------------------------------------------------------------------
def test_children_of_a_one_service_task(stack, docker_client):
    """Files, session cwd and environment carried; independent futures; each child evaluates on
    its own; the parent closed before its children; forks of forks; images gone at the end."""
    parent = started(stack, "hello-file")
    sh(stack, parent, "echo parent-wrote > /app/before.txt")
    start_shell(stack, parent, "repl", "/tmp/deep/dir")
    job, (one, two) = fork(stack, parent, 2)
    assert job["state"] == "succeeded", job
    assert job["result"]["processes"] == "restarted" and job["result"]["sessions_restarted"] == ["repl"]
    assert job["result"]["processes_reason"] == forking.process_carry("auto")[1]

    record = get_run(stack, one)
    assert (record["parent"], record["fork_depth"], record["processes"], record["state"]) == (
        parent,
        1,
        "restarted",
        "ready",
    )
    assert set(get_run(stack, parent)["children"]) == {one, two}
    assert f'href="/ui/runs/{parent}"' in stack.get(f"/ui/runs/{one}").text  # the viewer links both ways
    assert all(f'href="/ui/runs/{child}"' in stack.get(f"/ui/runs/{parent}").text for child in (one, two))
    assert record["user_msg"] == get_run(stack, parent)["user_msg"]
    for child in (one, two):
        assert sh(stack, child, "cat /app/before.txt").strip() == "parent-wrote"
        said = shell_says(stack, child, "repl", "echo cwd=$(pwd) var=$FORKED_VAR")
        assert "cwd=/tmp/deep/dir var=carried" in said, said
    assert "cwd=/tmp/deep/dir" in shell_says(stack, parent, "repl", "echo cwd=$(pwd)")  # the parent goes on

    # Independent futures: a write in one is seen neither in its sibling nor in the parent.
    sh(stack, one, "echo one > /app/only-one.txt")
    sh(stack, parent, "echo later > /app/parent-later.txt")
    assert "No such file" in sh(stack, two, "cat /app/only-one.txt 2>&1")
    assert "No such file" in sh(stack, parent, "cat /app/only-one.txt 2>&1")
    assert "No such file" in sh(stack, one, "cat /app/parent-later.txt 2>&1")

    # Each child evaluates on its own: one solves the task, the other does not.
    for step in solution_script("hello-file"):
        finished(stack, tool_call(stack, one, step["name"], **step["arguments"]))
    assert evaluate(stack, one) == 1.0
    assert evaluate(stack, two) < 1.0

    # The parent closes first; its children go on, and a child forks again.
    images = fork_images(docker_client, stack, parent)
    assert images, "the fork left no committed image"
    close_all(stack, docker_client, parent)
    assert sh(stack, two, "cat /app/before.txt").strip() == "parent-wrote"
    sh(stack, two, "echo two > /app/two.txt")
    job, (grandchild,) = fork(stack, two, 1)
    assert job["state"] == "succeeded", job
    assert get_run(stack, grandchild)["fork_depth"] == 2
    assert sh(stack, grandchild, "cat /app/before.txt /app/two.txt").split() == ["parent-wrote", "two"]

    # Images go with the last run that needs them (the grandchild needs its grandparent's too).
    close_all(stack, docker_client, one, two)
    assert all(docker_client.images.list(name=image) for image in images), "an image still needed was removed"
    close_all(stack, docker_client, grandchild)
    assert wait_for(lambda: not fork_images(docker_client, stack, parent), 30), fork_images(
        docker_client, stack, parent
    )
    assert wait_for(lambda: not fork_images(docker_client, stack, two), 30), fork_images(docker_client, stack, two)


# ---- compose task ---------------------------------------------------------------------------
def _service(docker_client, env: dict, service: str):
    [container] = docker_client.containers.list(
        filters={"label": [f"com.docker.compose.project={env['project']}", f"com.docker.compose.service={service}"]}
    )
    return container


def test_children_of_a_compose_task_carry_every_service(stack, docker_client):
    store = Store.from_url(stack.env["REDIS_URL"])
    parent = started(stack, "sidecar-kv")
    kv = _service(docker_client, store.get_run(parent)["env"], "kv")
    assert kv.exec_run(["sh", "-c", "echo sidecar-file > /tmp/kv-note"]).exit_code == 0
    sh(stack, parent, "echo client-file > /app/note.txt")
    job, (child,) = fork(stack, parent, 1)
    assert job["state"] == "succeeded", job
    env = store.get_run(child)["env"]
    assert env["mode"] == "compose" and env["project"] != store.get_run(parent)["env"]["project"]
    child_kv = _service(docker_client, env, "kv")
    assert child_kv.exec_run(["cat", "/tmp/kv-note"]).output.decode().strip() == "sidecar-file"
    assert sh(stack, child, "cat /app/note.txt").strip() == "client-file"
    # The child's own network: its client reaches its own kv (the task's tests need it).
    for step in solution_script("sidecar-kv"):
        finished(stack, tool_call(stack, child, step["name"], **step["arguments"]))
    assert evaluate(stack, child) == 1.0
    assert "No such file" in sh(stack, parent, "cat /app/secret.txt 2>&1")
    close_all(stack, docker_client, parent, child)
    assert wait_for(lambda: not fork_images(docker_client, stack, parent), 30)


# ---- bad input and faults -------------------------------------------------------------------
def _nothing_placed(stack, before: set) -> None:
    store = Store.from_url(stack.env["REDIS_URL"])
    assert set(store.live_runs(stack.host_id)) == before


def test_bad_forks_are_refused_and_leave_nothing(stack, docker_client):
    store = Store.from_url(stack.env["REDIS_URL"])
    run_id = started(stack, "hello-file")
    before = set(store.live_runs(stack.host_id))
    assert_error(stack.post("/v1/runs/run-0000000000000000/fork", {"count": 1}), 404, "", "UNKNOWN_RUN")
    for body in ({"count": 0}, {"count": -1}, {"count": "2"}, {"count": 1.5}, {}, {"count": 1000}):
        assert_error(stack.post(f"/v1/runs/{run_id}/fork", body), 400, "count", "BAD_REQUEST")
    assert_error(stack.post(f"/v1/runs/{run_id}/fork", {"count": 60}), 429, "free run slots", "RUN_SLOTS_EXHAUSTED")
    lease = stack.client.allocate("hello-file").id  # allocated, never reset: not started
    assert_error(stack.post(f"/v1/runs/{lease}/fork", {"count": 1}), 409, "started", "RUN_NOT_READY")
    store.update_run(run_id, fork_depth=stack_settings_depth(stack))
    assert_error(stack.post(f"/v1/runs/{run_id}/fork", {"count": 1}), 409, "FORK_MAX_DEPTH", "FORK_TOO_DEEP")
    store.update_run(run_id, fork_depth=0)
    _nothing_placed(stack, before | {lease})
    stack.client.lease(lease).close()
    close_all(stack, docker_client, run_id)
    assert_error(stack.post(f"/v1/runs/{run_id}/fork", {"count": 1}), 409, "closed", "RUN_CLOSED")


def stack_settings_depth(stack) -> int:
    return int(stack.env.get("FORK_MAX_DEPTH") or 4)


def test_a_docker_fault_during_a_fork_leaves_nothing(stack, docker_client):
    """The source's container vanishes under the fork (as a Docker fault would): the job fails,
    its children are closed with the reason, no container or image of theirs is left."""
    store = Store.from_url(stack.env["REDIS_URL"])
    run_id = started(stack, "hello-file")
    for container in run_containers(docker_client, store, run_id):
        container.remove(force=True)
    job, children = fork(stack, run_id, 2)
    assert job["state"] == "failed" and job["code"], job
    for child in children:
        record = get_run(stack, child)
        assert record["state"] == "closed" and "fork" in (record["error"] or ""), record
        assert not run_containers(docker_client, store, child)
        assert not store.images_needed(child)
    assert not fork_images(docker_client, stack, run_id)
    close_all(stack, docker_client, run_id)


def test_status_says_whether_forks_carry_processes(stack):
    """The machine's own dockerd runs without --experimental: forks restart processes here, and
    /status and the child's record say why (tests/test_fork_processes.py carries them)."""
    carried, reason = forking.process_carry("auto")
    status = requests.get(f"{stack.url}/status", timeout=10).json()["pool"]["hosts"][stack.host_id]
    assert status["fork_processes"] == {"carried": carried, "reason": reason}


# ---- Harbor task, through the pool API's POST /fork -----------------------------------------
@pytest.fixture(scope="module")
def hstack(base_image, docker_client):
    yield from private_stack(docker_client, STACK_ENV)  # the Harbor tests' dataset and settings


def test_fork_a_harbor_task_through_the_pool_api(hstack, docker_client):
    lease, _ = harbor_reset(hstack, "harbor-hello")
    harbor_sh(hstack, lease, "echo from-parent > /tmp/carried.txt")
    reply = hstack.client.request("POST", "/fork", json={"lease_id": lease, "count": 1})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["ok"] is True and len(body["lease_ids"]) == 1, body
    [child] = body["lease_ids"]
    assert harbor_sh(hstack, child, "cat /tmp/carried.txt").strip() == "from-parent"
    harbor_solve(hstack, child, "harbor-hello")
    evaluated = hstack.client.request("POST", "/evaluate", json={"lease_id": child})
    assert evaluated.status_code == 200 and evaluated.json()["score"] == 1.0, evaluated.text
    bad = hstack.client.request("POST", "/fork", json={"lease_id": lease, "count": 0})
    assert bad.status_code == 400 and bad.json()["code"] == "BAD_REQUEST", bad.text
    harbor_close(hstack, docker_client, lease)
    harbor_close(hstack, docker_client, child)
    assert wait_for(lambda: not fork_images(docker_client, hstack, lease), 30)


def test_a_worker_killed_during_a_fork_leaves_nothing(hstack, docker_client):
    """The lifecycle worker dies (-9) in the middle of a fork: the job fails WORKER_LOST, and the
    host's reconcile (as beat sends it) closes the children still starting and removes the
    images no run needs, whatever step the fork had reached."""
    store = Store.from_url(hstack.env["REDIS_URL"])
    lease, _ = harbor_reset(hstack, "harbor-hello")
    harbor_sh(hstack, lease, "head -c 300000000 /dev/zero > /tmp/big.bin")  # a commit that takes a while
    reply = hstack.post(f"/v1/runs/{lease}/fork", {"count": 2})
    assert reply.status_code == 202, reply.text
    job_id, children = reply.json()["job_id"], reply.json()["run_ids"]
    assert wait_for(lambda: store.get_job(job_id)["state"] == "running", 60, 0.05)
    hstack.kill("lifecycle")
    hstack.start_worker("lifecycle")
    job = finished(hstack, job_id)
    assert job["state"] == "failed" and job["code"] == "WORKER_LOST", job
    make_celery(load_settings(hstack.env)).send_task("pool.reconcile", kwargs={"host": hstack.host_id})
    for child in children:
        assert wait_for(lambda c=child: get_run(hstack, c)["state"] == "closed", 60), get_run(hstack, child)
        assert wait_for(lambda c=child: not run_containers(docker_client, store, c), 60), child
    assert wait_for(lambda: not fork_images(docker_client, hstack, lease), 60), fork_images(
        docker_client, hstack, lease
    )
    assert harbor_sh(hstack, lease, "ls /tmp/big.bin").strip() == "/tmp/big.bin"  # the source goes on
    harbor_close(hstack, docker_client, lease)


def test_a_forged_session_pid_file_is_not_followed(stack, docker_client):
    """The task can rewrite a session's pid file: the fork reads only a numeric pid's /proc
    entries, never a file the task points it to (here a 64 MB one)."""
    run_id = started(stack, "hello-file")
    assert "started" in call(stack, run_id, "shell_exec", id="s", command="sleep 1000", block=False)
    sh(stack, run_id, "mkdir -p /tmp/x/cwd && head -c 67108864 /dev/zero > /tmp/x/environ")
    sh(stack, run_id, "printf 'sleep\\0' > /tmp/x/cmdline")  # would pass for a session's command line
    sh(stack, run_id, f"echo '1 1 ../tmp/x' > {session_dir('s')}/pid")
    job, (child,) = fork(stack, run_id, 1)
    assert job["state"] == "succeeded" and job["result"]["sessions_restarted"] == [], job
    close_all(stack, docker_client, run_id, child)


@pytest.mark.parametrize(
    ("version", "reason"),
    [
        ("Version: 3.17.1", "criu 3.17 is older than 4.2"),
        ("Version: 4.1", "criu 4.1 is older than 4.2"),
        ("Version: 4.2\nGitID: v4.2", None),
    ],
)
def test_process_carry_reads_criu_version(tmp_path, monkeypatch, version, reason):
    """The start-up check reads `criu --version` (a script standing in for it here); a new
    enough CRIU goes on to ask dockerd whether it runs with experimental features."""
    criu = tmp_path / "criu"
    criu.write_text(f"#!/bin/sh\nprintf '{version}\\n'\n")
    criu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    carried, found = forking.process_carry("auto")
    if reason:
        assert (carried, found) == (False, reason)
    else:
        assert "experimental" in found or carried, found
    assert forking.process_carry("off") == (False, "FORK_PROCESSES=off")
