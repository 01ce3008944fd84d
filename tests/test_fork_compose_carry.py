"""Process carry in forks of a compose run, for real (the second, experimental dockerd with CRIU
of tests/test_fork_processes.py): every service's processes go on in the children, each child on
its own network. The compose-counter fixture's sidecar keeps its count only in its process's
memory and listens on 0.0.0.0; the client reaches it by its service name. An established TCP
connection between services (CRIU refuses it at the checkpoint) and a listener bound to the
client's own address (the child has another one: the restore fails) fall back to restarting,
with the reason naming the service, and leave no checkpoint, container or image behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from environments.compose_config import start_order
from poolcore.state import Store
from tasks.fork_jobs import CHECKPOINT_PREFIX
from tests import test_fork_processes
from tests.conftest import wait_for
from tests.test_fork import call, close_all, fork, fork_images, started
from tests.test_fork_processes import COUNTER, carry_stack_client, count, fork_restarting
from tests.test_runs_api import get_run

compose_stack = test_fork_processes.carry_stack  # its second dockerd, one per module

TASK = "compose-counter"
ASK = "python3 -c \"import urllib.request as u; print(u.urlopen('http://counter:8000/', timeout=10).read().decode())\""


def ask(stack, run_id: str) -> tuple[str, int]:
    """The sidecar's answer, asked from the client by service name: (its stamp, its count)."""
    stamp, number = call(stack, run_id, "shell_exec", id="ask", command=ASK, block=True).split()[-2:]
    return stamp, int(number)


def project(stack, run_id: str) -> str:
    return Store.from_url(stack.env["REDIS_URL"]).get_run(run_id)["env"]["project"]


def leftover_checkpoints(client, stack, run_id: str) -> list[str]:
    """Checkpoint folders a fork left in the run's containers."""
    root = Path(client.info()["DockerRootDir"]) / "containers"
    found = client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project(stack, run_id)}"})
    return [str(p) for c in found for p in (root / c.id / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*")]


def test_every_service_of_a_compose_run_is_carried(compose_stack):
    stack, client = compose_stack, carry_stack_client(compose_stack)
    parent = started(stack, TASK)
    assert "started" in call(stack, parent, "shell_exec", id="counter", command=COUNTER, block=False)
    for _ in range(3):
        stamp, asked = ask(stack, parent)
    assert asked == 3
    assert wait_for(lambda: count(stack, parent)[1] >= 10, 30)
    loop_stamp, before = count(stack, parent)

    job, (one, two) = fork(stack, parent, 2)
    assert job["state"] == "succeeded", job
    result = job["result"]
    assert (result["processes"], result["processes_reason"], result["sessions_restarted"]) == ("carried", "", [])
    for child in (one, two):
        record = get_run(stack, child)
        assert (record["processes"], record["processes_reason"]) == ("carried", ""), record["processes_reason"]
        assert project(stack, child) != project(stack, parent)
        child_stamp, at_fork = count(stack, child)  # the client's session loop goes on
        assert child_stamp == loop_stamp and at_fork >= before, (loop_stamp, before, child_stamp, at_fork)
    assert leftover_checkpoints(client, stack, parent) == []
    # The sidecar goes on from its count in each child, on the child's own network.
    assert ask(stack, one) == (stamp, 4)
    assert ask(stack, one) == (stamp, 5)
    assert ask(stack, two) == (stamp, 4)  # the sibling's sidecar is its own
    assert ask(stack, parent) == (stamp, 4)  # and so is the parent's
    for child in (one, two):
        assert wait_for(lambda child=child: count(stack, child)[1] > at_fork, 30), count(stack, child)
    close_all(stack, client, parent, one, two)
    assert wait_for(lambda: not fork_images(client, stack, parent), 30), fork_images(client, stack, parent)


def test_an_established_connection_between_services_restarts_processes(compose_stack):
    """CRIU refuses a connected TCP socket (dockerd asks for no --tcp-established): the whole
    fork restarts processes, and the reason names the service whose checkpoint failed."""
    stack, client = compose_stack, carry_stack_client(compose_stack)
    parent = started(stack, TASK)
    stamp, _ = ask(stack, parent)
    held = "python3 -c \"import socket,time; c=socket.create_connection(('counter',8000)); time.sleep(1e6)\""
    child = fork_restarting(stack, parent, "tcp", held)
    reason = get_run(stack, child)["processes_reason"]
    assert reason.startswith(("service 'client': checkpoint", "service 'counter': checkpoint")), reason
    assert "tcp" in reason.lower(), reason
    fresh, asked = ask(stack, child)
    assert fresh != stamp and asked == 1  # the child's sidecar started afresh
    assert leftover_checkpoints(client, stack, parent) == []
    close_all(stack, client, parent, child)
    assert wait_for(lambda: not fork_images(client, stack, parent), 30), fork_images(client, stack, parent)


def test_a_failed_restore_restarts_the_whole_child(compose_stack):
    """A listener bound to the client's own address is checkpointed, but the child's client has
    another address: its restore fails after the sidecar's succeeded. The restored sidecar is
    stopped and the child starts afresh: no half-restored child."""
    stack, client = compose_stack, carry_stack_client(compose_stack)
    parent = started(stack, TASK)
    stamp, _ = ask(stack, parent)
    bind = (
        'python3 -c "import socket,time; s=socket.socket(); '
        's.bind((socket.gethostbyname(socket.gethostname()), 9000)); s.listen(); time.sleep(1e6)"'
    )
    child = fork_restarting(stack, parent, "bind", bind)
    reason = get_run(stack, child)["processes_reason"]
    assert reason.startswith("service 'client': restore"), reason
    fresh, asked = ask(stack, child)
    assert fresh != stamp and asked == 1  # the child's sidecar started afresh, not half-restored
    assert ask(stack, parent)[0] == stamp
    assert leftover_checkpoints(client, stack, parent) == leftover_checkpoints(client, stack, child) == []
    close_all(stack, client, parent, child)
    assert wait_for(lambda: not fork_images(client, stack, parent), 30), fork_images(client, stack, parent)


# ---- without Docker -------------------------------------------------------------------------
@pytest.mark.unit
def test_services_are_restored_in_dependency_order():
    resolved = {
        "services": {
            "client": {"depends_on": {"cache": {"condition": "service_started"}, "db": {}}},
            "cache": {"depends_on": {"db": {"condition": "service_healthy"}}},
            "db": {},
        }
    }
    assert start_order(resolved) == ["db", "cache", "client"]
