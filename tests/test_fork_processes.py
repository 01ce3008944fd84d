"""Process carry in forks, for real: a second dockerd started with --experimental and the CRIU
4.2 that devstack/criu.py unpacks first on its PATH (and on its workers'), a stack whose one
worker host uses that daemon. A run's background loop, which keeps its count in memory, and
its interactive shell go on in the fork's children from where they were; a checkpoint CRIU
refuses falls back to restarting the sessions, with the reason recorded. Skipped with the
reason where CRIU 4.2 cannot be set up (no Debian unstable packages reachable)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import docker
import pytest
import requests

from devstack import criu
from devstack.second_docker import SecondDocker
from devstack.stack import Stack
from poolcore.config import load_settings
from poolcore.queues import make_celery
from poolcore.state import Store
from tasks.fork_jobs import CHECKPOINT_PREFIX, Carry
from tests.conftest import run_containers, stop_checking_leaks, wait_for
from tests.test_fork import call, close_all, fork, shell_says, start_shell, started
from tests.test_runs_api import get_run

# A loop whose count lives in the shell's memory; the file only shows it (replaced whole, by a
# rename: never read half-written). A restarted loop would count from 1 again under a new
# start stamp.
COUNTER = (
    's=$(date +%s%N); i=0; while :; do i=$((i+1)); echo "$s $i" > /tmp/count.new; '
    "mv /tmp/count.new /tmp/count; sleep 0.2; done"
)


@pytest.fixture(scope="module")
def carry_stack(base_image):
    try:
        criu_dir = criu.ensure()
    except criu.CriuUnavailable as exc:
        print(f"process carry not tested: {exc}")
        pytest.skip(f"CRIU 4.2 cannot be set up here: {exc}")
    daemon = SecondDocker(experimental=True, path_first=str(criu_dir), args=criu.dockerd_args())
    try:
        daemon.start()
        daemon.load_image(base_image)
        path = f"{criu_dir}:{os.environ['PATH']}"
        stack = Stack(env={"DOCKER_HOST": daemon.host, "PATH": path}).start()
        second = daemon.client()
        try:
            yield stack
        finally:
            stop_checking_leaks(stack, second)
            second.close()
    finally:
        daemon.stop()


def carry_stack_client(stack) -> docker.DockerClient:
    return docker.DockerClient(base_url=stack.env["DOCKER_HOST"], timeout=120)


def count(stack, run_id: str) -> tuple[str, int]:
    """The loop's (start stamp, count); ("", 0) before its first write."""
    said = call(stack, run_id, "shell_exec", id="look", command="cat /tmp/count 2>/dev/null", block=True).split()
    return (said[-2], int(said[-1])) if len(said) >= 2 and said[-1].isdigit() else ("", 0)


def fork_restarting(stack, run_id: str, sid: str, command: str) -> str:
    """Start `command` in session `sid`, fork one child: its processes are restarted, that
    session with them. The child's id."""
    assert "started" in call(stack, run_id, "shell_exec", id=sid, command=command, block=False)
    time.sleep(1)
    job, (child,) = fork(stack, run_id, 1)
    assert job["state"] == "succeeded", job
    assert (job["result"]["processes"], job["result"]["sessions_restarted"]) == ("restarted", [sid]), job["result"]
    return child


def test_processes_are_carried_into_children(carry_stack):
    stack = carry_stack
    status = requests.get(f"{stack.url}/status", timeout=10).json()["pool"]["hosts"][stack.host_id]
    assert status["fork_processes"]["carried"] is True, status["fork_processes"]
    parent = started(stack, "hello-file")
    assert "started" in call(stack, parent, "shell_exec", id="counter", command=COUNTER, block=False)
    start_shell(stack, parent, "repl", "/tmp/deep")
    shell_says(stack, parent, "repl", "export LATE=exported-after-start")  # only the shell's memory has it
    assert wait_for(lambda: count(stack, parent)[1] >= 15, 30)
    stamp, before = count(stack, parent)

    job, children = fork(stack, parent, 2)
    assert job["state"] == "succeeded", job
    assert (job["result"]["processes"], job["result"]["sessions_restarted"]) == ("carried", []), job["result"]
    for child in children:
        record = get_run(stack, child)
        assert (record["processes"], record["processes_reason"]) == ("carried", ""), record["processes_reason"]
        child_stamp, at_fork = count(stack, child)
        assert child_stamp == stamp and at_fork >= before, (stamp, before, child_stamp, at_fork)
        said = shell_says(stack, child, "repl", "echo cwd=$(pwd) late=$LATE var=$FORKED_VAR")
        assert "cwd=/tmp/deep late=exported-after-start var=carried" in said, said
    for child in children:  # the loops run on in each child, counting on from the fork
        assert wait_for(lambda child=child: count(stack, child)[1] > at_fork, 30), count(stack, child)
    assert count(stack, parent)[0] == stamp  # the source goes on, its loop never stopped
    shell_says(stack, children[0], "repl", "export LATE=changed-in-one")
    assert "late=exported-after-start" in shell_says(stack, children[1], "repl", "echo late=$LATE")
    close_all(stack, carry_stack_client(stack), parent, *children)


def test_a_refused_checkpoint_restarts_processes(carry_stack):
    """CRIU refuses an established TCP connection (dockerd asks for no --tcp-established): the
    fork goes on and restarts the sessions, and the child's record says why."""
    stack = carry_stack
    parent = started(stack, "hello-file")
    held = (
        "python3 -c \"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
        'c=socket.create_connection(s.getsockname()); a,_=s.accept(); time.sleep(1e6)"'
    )
    child = fork_restarting(stack, parent, "tcp", held)
    record = get_run(stack, child)
    assert record["processes"] == "restarted" and "checkpoint" in record["processes_reason"], record
    close_all(stack, carry_stack_client(stack), parent, child)


def test_the_reconcile_removes_checkpoints_of_forks_that_never_ended(carry_stack):
    """A worker killed between checkpoint and cleanup leaves the source's checkpoint folder:
    the host's reconcile removes it once it is older than a fork takes, not a fresh one."""
    stack = carry_stack
    run_id = started(stack, "hello-file")
    client = carry_stack_client(stack)
    [container] = run_containers(client, Store.from_url(stack.env["REDIS_URL"]), run_id)
    folder = Path(client.info()["DockerRootDir"]) / "containers" / container.id / "checkpoints"
    stale, fresh = folder / f"{CHECKPOINT_PREFIX}stale", folder / f"{CHECKPOINT_PREFIX}fresh"
    for made in (stale, fresh):
        made.mkdir(parents=True)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    make_celery(load_settings(stack.env)).send_task("pool.reconcile", kwargs={"host": stack.host_id})
    assert wait_for(lambda: not stale.exists(), 30)
    assert fresh.is_dir()
    close_all(stack, client, run_id)


# ---- without Docker -------------------------------------------------------------------------
def test_runc_options_adds_file_locks_once(tmp_path):
    conf = tmp_path / "criu" / "runc.conf"
    criu.runc_options(conf)
    assert conf.read_text() == "file-locks\n"
    conf.write_text("tcp-established\n")
    criu.runc_options(conf)
    criu.runc_options(conf)
    assert conf.read_text().split() == ["tcp-established", "file-locks"]


def test_a_fork_says_why_it_restarts_processes():
    carry = Carry(name="termpool-fork-x")
    carry.carried.update(a=True, b="restore of b: criu failed")
    assert carry.why(["a"]) == "" and carry.why(["a", "b"]) == "restore of b: criu failed"
    carry.reason = "criu is not on PATH"
    assert carry.why(["a"]) == "criu is not on PATH"
