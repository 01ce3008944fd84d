"""The per-run disk limit (CONTAINER_DISK_LIMIT, a task's own storage request) and host disk
pressure (HOST_DISK_MIN_FREE): the arithmetic, the state store's part on a private Redis, and
against real stacks: a run that writes past a small limit ends with RUN_DISK_LIMIT within the
check period and leaves no container, one under it is untouched, and a host short of disk takes
no new runs (429 HOST_DISK_LOW, shown in /status) until it has room again."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from app.engine import RunEnded, raise_if_ended
from app.refusal_texts import capacity_message
from devstack import WORKER_KINDS
from environments.disk_usage import folder_bytes
from poolcore import disk
from poolcore.config import DiskFloor, load_settings
from poolcore.state import CapacityError, Store
from tasks.disk_check import run_bytes
from termpool.client import RunDiskLimit
from tests.conftest import private_stack, run_containers, wait_for
from tests.test_placement import place, see

MIB = 1 << 20
GIB = 1 << 30


# ---- pure logic -------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_lower_of_the_setting_and_the_tasks_own_request_wins():
    assert disk.run_limit(10 * GIB, None) == 10 * GIB
    assert disk.run_limit(10 * GIB, 2048) == 2 * GIB  # Harbor's storage_mb below the setting
    assert disk.run_limit(1 * GIB, 4096) == 1 * GIB  # the setting below the task's request
    assert disk.run_limit(0, 512) == 512 * MIB  # no setting: the task's own
    assert disk.run_limit(0, None) == 0  # neither: no limit


@pytest.mark.unit
def test_over_limit_is_strictly_past_it_and_no_limit_is_never_over():
    assert not disk.over_limit(100, 100)
    assert disk.over_limit(101, 100)
    assert not disk.over_limit(10**15, 0)


@pytest.mark.unit
def test_disk_settings_are_read_and_checked():
    cfg = load_settings({})
    assert cfg.container_disk_limit == 10 * GIB
    assert cfg.host_disk_min_free == DiskFloor(percent=5.0)
    assert cfg.record_ttl == 24 * 3600 and cfg.disk_check_seconds == 10.0
    cfg = load_settings({"CONTAINER_DISK_LIMIT": "64m", "HOST_DISK_MIN_FREE": "20g", "RECORD_TTL": "3600"})
    assert cfg.container_disk_limit == 64 * MIB
    assert cfg.host_disk_min_free == DiskFloor(bytes=20 * GIB)
    assert cfg.record_ttl == 3600
    for bad in ({"HOST_DISK_MIN_FREE": "120%"}, {"HOST_DISK_MIN_FREE": "lots"}, {"RECORD_TTL": "5"}):
        with pytest.raises(ValueError):
            load_settings(bad)


@pytest.mark.unit
def test_a_host_is_short_of_disk_under_either_floor():
    percent, size = DiskFloor(percent=10.0), DiskFloor(bytes=5 * GIB)
    assert percent.short_of(free=9 * GIB, total=100 * GIB)
    assert not percent.short_of(free=11 * GIB, total=100 * GIB)
    assert size.short_of(free=4 * GIB, total=1000 * GIB)
    assert not size.short_of(free=6 * GIB, total=10 * GIB)
    spaces = [
        disk.Space("docker", "/var/lib/docker", 4 * GIB, 100 * GIB),
        disk.Space("output", "/out", 50 * GIB, 100 * GIB),
    ]
    reason = disk.shortage(spaces, size)
    assert reason.startswith("docker root /var/lib/docker has 4.0 GiB free") and "/out" not in reason
    assert disk.shortage(spaces, DiskFloor(bytes=GIB)) == ""


@pytest.mark.unit
def test_folder_bytes_counts_allocated_blocks_and_follows_only_top_links(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data").write_bytes(os.urandom(3 * MIB))
    with open(tmp_path / "sparse", "wb") as sparse:  # 1 GiB long, holds nothing
        sparse.truncate(GIB)
    outside = tmp_path.parent / (tmp_path.name + "-linked")
    outside.mkdir()
    (outside / "log").write_bytes(os.urandom(MIB))
    (tmp_path / "logs").symlink_to(outside)
    assert 3 * MIB <= folder_bytes(tmp_path) < 3 * MIB + 64 * 1024  # the link is not followed
    assert 4 * MIB <= folder_bytes(tmp_path, follow_top_links=True) < 4 * MIB + 64 * 1024
    assert folder_bytes(tmp_path / "gone") == 0 and folder_bytes("") == 0


@pytest.mark.unit
def test_a_run_counts_its_layers_its_warm_containers_and_its_run_dir(tmp_path):
    (tmp_path / "out").write_bytes(os.urandom(MIB))
    run = {"run_id": "run-1", "env": {"warm_id": "warm-9", "run_dir": str(tmp_path)}}
    layers = {"run-1": 10 * MIB, "warm-9": 5 * MIB, "run-2": 99 * MIB}
    assert 16 * MIB <= run_bytes(run, layers) < 16 * MIB + 64 * 1024


@pytest.mark.unit
def test_calls_on_an_ended_run_answer_its_code():
    ended = {"run_id": "run-1", "state": "closing", "closing_reason": "RUN_DISK_LIMIT", "error": "too big"}
    with pytest.raises(RunEnded) as raised:
        raise_if_ended(ended)
    assert (raised.value.code, str(raised.value)) == ("RUN_DISK_LIMIT", "too big")
    raise_if_ended({**ended, "closing_reason": "closed"})  # a plain close: RUN_CLOSED as before
    raise_if_ended(None)
    message = capacity_message("task-a", "HOST_DISK_LOW", reason="host h: docker root is short")
    assert "short of disk (host h: docker root is short)" in message


# ---- the state store (a private Redis) --------------------------------------------------------
@pytest.fixture
def store(redis_server) -> Store:
    redis_server.flushall()
    return Store(redis_server)


@pytest.fixture
def cfg():
    return load_settings({"POOL_HOST_ID": "facade-host", "WORKER_MAX_TASKS": "4", "WORKER_MAX_RUNS_PER_TASK": "5"})


@pytest.fixture
def watch(store, cfg):
    from poolcore import hosts

    return hosts.make_watch(cfg, store)


def short_of_disk(store: Store, host: str, reason: str) -> None:
    """What the host's heartbeat publishes (tasks/disk_check.host_facts) when it is short of disk."""
    store.host_beat(host, f"exec-x-1@{host}", "exec", {"max_tasks": 4, "max_runs_per_task": 5, "disk_low": reason})


def test_placement_skips_a_host_short_of_disk(store, cfg, watch):
    see(store, watch, "a")
    see(store, watch, "b")
    short_of_disk(store, "a", "docker root is short")
    assert {place(store, cfg, watch, key=f"k{i}").host for i in range(4)} == {"b"}
    short_of_disk(store, "b", "output root is short")
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch, key="k9")
    assert raised.value.code == "HOST_DISK_LOW"
    assert raised.value.reason == "host a: docker root is short; host b: output root is short"
    short_of_disk(store, "a", "")  # room again
    assert place(store, cfg, watch, key="k9").host == "a"


def test_a_full_host_beside_one_short_of_disk_is_a_slots_refusal(store, cfg, watch):
    see(store, watch, "a", max_tasks=1, max_runs=1)
    see(store, watch, "b")
    place(store, cfg, watch, key="k0")  # fills a (b is short of disk from now on)
    short_of_disk(store, "b", "short")
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch, key="k1")
    assert raised.value.code == "TASK_SLOTS_EXHAUSTED"


def test_end_run_keeps_the_code_releases_and_fails_its_jobs(store, cfg, watch):
    see(store, watch, "a")
    run_id = place(store, cfg, watch).run_id
    assert store.end_run(run_id, "RUN_DISK_LIMIT", "too big") is None  # not started: left alone
    store.update_run(run_id, state="busy")
    store.create_job("job-1", run_id, "tool_call")
    assert store.end_run(run_id, "RUN_DISK_LIMIT", "too big") == "a"
    run = store.get_run(run_id)
    assert (run["state"], run["closing_reason"], run["code"], run["retryable"]) == (
        "closing",
        "RUN_DISK_LIMIT",
        "RUN_DISK_LIMIT",
        False,
    )
    assert store.get_job("job-1")["code"] == "RUN_DISK_LIMIT"
    assert store.host_status("a")["total_active_runs"] == 0
    assert store.end_run(run_id, "RUN_DISK_LIMIT", "again") is None  # once


# ---- against a real stack ---------------------------------------------------------------------
LIMIT_MB = 64
CHECK_SECONDS = 2.0


@pytest.fixture(scope="module")
def limited_stack(base_image, docker_client):
    env = {"CONTAINER_DISK_LIMIT": f"{LIMIT_MB}m", "DISK_CHECK_SECONDS": str(CHECK_SECONDS), "WARM_POOL_SIZE": "0"}
    yield from private_stack(docker_client, env, beat=True)


def test_a_run_past_its_limit_ends_and_one_under_it_goes_on(limited_stack, docker_client):
    pool = limited_stack.client
    store = Store(limited_stack.redis)
    with pool.start("hello-file") as big, pool.start("hello-file") as small:
        small.exec(f"head -c {LIMIT_MB // 4}M /dev/zero > /tmp/quarter")
        assert store.get_run(big.id)["disk_limit"] == LIMIT_MB * MIB
        with contextlib.suppress(RunDiskLimit):  # a check may end the run while it writes: its call fails so
            big.exec(f"head -c {2 * LIMIT_MB}M /dev/zero > /tmp/twice")
        # Ended within a check period or two (beat's period, then the host's measure).
        assert wait_for(lambda: store.get_run(big.id)["state"] in ("closing", "closed"), 6 * CHECK_SECONDS)
        reply = pool.request(
            "POST",
            f"/v1/runs/{big.id}/tool_calls",
            json={"name": "shell_exec", "arguments": {"id": "a", "command": "ls", "block": True}},
        )
        assert reply.status_code == 409 and reply.json()["code"] == "RUN_DISK_LIMIT", reply.text
        assert reply.json()["retryable"] is False and "over its limit of 64 MiB" in reply.json()["error"]
        pool_reply = pool.request("POST", "/evaluate", json={"lease_id": big.id})
        assert pool_reply.status_code == 500 and pool_reply.json()["code"] == "RUN_DISK_LIMIT"
        assert wait_for(lambda: not run_containers(docker_client, store, big.id), 60), "its containers stayed"
        record = pool.request("GET", f"/v1/runs/{big.id}").json()["run"]
        assert (record["code"], record["retryable"], record["disk_limit"]) == ("RUN_DISK_LIMIT", False, LIMIT_MB * MIB)
        assert small.exec("cat /tmp/quarter | wc -c").strip() == str(LIMIT_MB // 4 * MIB)
        assert store.get_run(small.id)["state"] in ("ready", "busy")


@pytest.fixture(scope="module")
def short_stack(base_image, docker_client):
    """A host whose HOST_DISK_MIN_FREE (100%) is more than any disk has free."""
    yield from private_stack(docker_client, {"HOST_DISK_MIN_FREE": "100%", "WARM_POOL_SIZE": "0"})


def test_a_host_short_of_disk_takes_no_runs_until_it_has_room(short_stack):
    s = short_stack

    def disk() -> dict:
        return s.get("/status").json()["pool"]["hosts"][s.host_id]["disk"]

    # Docker's data root is measured once the workers have asked Docker for it (in the background).
    assert wait_for(lambda: len(disk()["spaces"]) == 2, 15), disk()
    assert {space["root"] for space in disk()["spaces"]} == {"docker", "output"}
    assert "under HOST_DISK_MIN_FREE=100%" in disk()["low"] and disk()["storage_quota"] == "", disk()
    refused = s.post("/allocate", {"task_key": "hello-file"})
    assert refused.status_code == 429, refused.text
    assert refused.json()["code"] == "HOST_DISK_LOW" and refused.json()["retryable"] is True
    assert f"host {s.host_id}: docker root" in refused.json()["error"]
    runs = s.post("/v1/runs", {"task_meta": {"task_name": "hello-file", "task_path": "hello-file"}})
    assert runs.status_code == 429 and runs.json()["code"] == "HOST_DISK_LOW", runs.text
    # The threshold lowered again (its workers restarted with it): the host takes runs.
    s.env["HOST_DISK_MIN_FREE"] = "1%"
    for kind in WORKER_KINDS:
        s.kill(kind, signal.SIGTERM)
        s.start_worker(kind)
    s.wait_serving(s.host_id)
    assert wait_for(lambda: not disk()["low"], 15), disk()
    allocated = s.post("/allocate", {"task_key": "hello-file"})
    assert allocated.status_code == 200, allocated.text
    assert s.post("/close", {"lease_id": allocated.json()["lease_id"]}).status_code == 200
