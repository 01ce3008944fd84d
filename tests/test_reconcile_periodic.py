"""The periodic reconcile sweep (beat -> pool.reconcile_hosts -> pool.reconcile per live host):
what Redis no longer knows goes within a minute; starting runs and warm containers stay."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from devstack import Stack
from poolcore.config import load_settings
from poolcore.queues import make_celery
from poolcore.state import Store, run_key, warm_key
from tests.conftest import Router, leftovers, wait_for


@pytest.fixture(scope="module")
def swept(base_image, docker_client):
    s = Stack(beat=True, durable_redis=True).start()  # the warm pool on, as by default
    yield s
    s.stop()
    left = leftovers(docker_client, s.host_id)
    for name in left:  # a close that met the Redis restart waits for the reaper's re-queue
        docker_client.containers.get(name).remove(force=True)
    assert not [name for name in left if "-warm-" in name], f"a clean stop left warm spares: {left}"


def run_env(stack, lease) -> dict:
    return Store(stack.redis).get_run(lease)["env"]


def networks_of(docker_client, lease) -> list:
    return docker_client.networks.list(filters={"label": f"termpool.run={lease}"})


def assert_lost_run_is_swept(stack, docker_client) -> None:
    router = Router(stack)
    orphan, kept = router.allocate("sidecar-kv"), router.allocate("hello-file")
    for lease, task in ((orphan, "sidecar-kv"), (kept, "hello-file")):
        reply = router.reset(lease, task)
        assert reply.status_code == 200, reply.text
    ctl_dir = run_env(stack, orphan).get("ctl_dir")
    assert len(router.run_containers(docker_client, orphan)) == 2 and networks_of(docker_client, orphan)
    assert not ctl_dir or Path(ctl_dir).is_dir()

    stack.redis.delete(run_key(orphan))  # a Redis that lost the run

    assert wait_for(lambda: not router.run_containers(docker_client, orphan), 90), "containers were not swept"
    assert wait_for(lambda: not networks_of(docker_client, orphan), 30), "networks were not swept"
    assert wait_for(lambda: not ctl_dir or not Path(ctl_dir).exists(), 30), "socket folder was not swept"
    # The run Redis still knows was left alone.
    assert router.sh(kept, "echo kept") == "kept\n"
    router.close(kept)


def test_orphans_of_a_lost_record_are_removed_within_a_minute(swept, docker_client):
    assert_lost_run_is_swept(swept, docker_client)


def test_beat_keeps_sweeping_after_a_redis_restart(swept, docker_client):
    swept.restart_redis(down_for=5)
    assert_lost_run_is_swept(swept, docker_client)


def test_sweeps_spare_starting_runs_and_warm_containers(swept, docker_client):
    """Sweeps fired back to back while a run starts and its task's warm pool fills."""
    router = Router(swept)
    celery = make_celery(load_settings(swept.env))
    pool_key = warm_key(swept.host_id, "partial-pass")
    stop = threading.Event()

    def sweep():
        while not stop.wait(0.3):
            celery.send_task("pool.reconcile", kwargs={"host": swept.host_id})

    sweeper = threading.Thread(target=sweep, daemon=True)
    sweeper.start()
    try:
        lease = router.allocate("partial-pass")
        reply = router.reset(lease, "partial-pass")  # cold: image build, then the start
        assert reply.status_code == 200, reply.text
        assert wait_for(lambda: Store(swept.redis).warm_count(swept.host_id, "partial-pass") == 1, 120), (
            "the warm pool did not fill"
        )
    finally:
        stop.set()
        sweeper.join()
    celery.send_task("pool.reconcile", kwargs={"host": swept.host_id})  # one more after the last start

    warm = json.loads(swept.redis.lindex(pool_key, 0))
    time.sleep(5)  # let that sweep run
    assert docker_client.containers.get(warm["client"]).status == "running", "a sweep removed the warm container"
    router.solve(lease, "partial-pass")
    assert router.evaluate(lease).json()["score"] == 0.75
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 90)
