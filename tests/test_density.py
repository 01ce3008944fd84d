"""A host full of runs (issue 29, part 3): N live runs of the two-service fixture task at once on
one host, through the real stack. While all N are live, every run answers a tool call that
reaches its own sidecar by service name (the reply names the sidecar's container: it must be
that run's own, so each run has a network of its own); then all are closed and nothing of the
host is left: no container, network or volume. No timing is checked here: the figures are
bench/density.py's.

TERMPOOL_DENSITY_RUNS sets N (64 by default).
"""

from __future__ import annotations

import os

import pytest

from bench.density_host import SERVICE_LABEL, left_behind
from bench.density_runs import TASK, Fleet, wait_closed
from bench.stats import Recorder
from environments.docker_client import RUN_LABEL
from environments.lifecycle import run_name
from tests.conftest import private_stack

N = int(os.environ.get("TERMPOOL_DENSITY_RUNS", "64"))


@pytest.fixture(scope="module")
def dense_stack(base_image, docker_client):
    env = {
        "WARM_POOL_SIZE": "0",  # a one-service task's pool; nothing to do here
        "WORKER_MAX_TASKS": "1",
        "WORKER_MAX_RUNS_PER_TASK": str(N),
        "LIFECYCLE_CONCURRENCY": "16",
        "TEARDOWN_CONCURRENCY": "8",
    }
    yield from private_stack(docker_client, env)


def live_runs(stack) -> int:
    return stack.get("/status").json()["pool"]["hosts"][stack.host_id]["live_runs"]


def own_sidecar(docker_client, lease: str) -> str:
    """The id of the run's own sidecar container, found by the run's labels."""
    labels = [f"{RUN_LABEL}={lease}", f"{SERVICE_LABEL}=side"]
    [side] = docker_client.containers.list(filters={"label": labels})
    return side.id


def test_live_runs_each_reach_their_own_sidecar(dense_stack, docker_client):
    fleet, rec = Fleet(dense_stack.url, parallel=16), Recorder()
    try:
        fleet.grow(N, rec)
        assert len(fleet.leases) == N, (
            f"{N - len(fleet.leases)} starts failed: {dict(fleet.codes)} {rec.error_messages}"
        )
        assert live_runs(dense_stack) == N
        answered = fleet.probe_all(rec)
        assert live_runs(dense_stack) == N  # all of them live while every one answered
        wrong = {
            lease: side
            for lease, side in answered.items()
            if not side or not own_sidecar(docker_client, lease).startswith(side)
        }
        assert not wrong, f"runs answered by no sidecar or another run's: {wrong}; {rec.error_messages}"
    finally:
        fleet.close_all(rec)
        fleet.stop()
    assert not fleet.codes, rec.error_messages
    assert wait_closed(dense_stack, 300), "teardowns still pending after 5 minutes"
    projects = [run_name(TASK, lease) for lease in fleet.ever]
    left = left_behind(docker_client, dense_stack.host_id, projects)
    assert not any(left.values()), f"left behind after every run closed: {left}"
