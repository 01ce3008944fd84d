"""Grey faults of the layers below the stack (issue 22): the Docker daemon restarted under live
runs, a crash of everything with Redis's append-only file kept, Redis at its memory limit.

Each is a scenario of `python -m chaos.run` (SCENARIOS below); run.py calls `backdrop` around
a scenario (the second Docker daemon docker-restart needs) and `inject` for its fault. Each
fault returns what it did and, where it checks its own outcome, what it found (run records
lost across the crash, half-written records after the memory limit).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import redis

from chaos import faults
from chaos.service import Service
from poolcore.state import keys

# (name, fault as the table says it, action)
SCENARIOS = (
    ("docker-restart", "restart the second Docker daemon under live runs (SIGTERM, same argv)", "docker-restart"),
    (
        "docker-restart-live",
        "the same, the daemon with live-restore (its containers keep running)",
        "docker-restart-live",
    ),
    ("kill-all-aof", "kill -9 whole stack + Redis, relaunch; records checked against the AOF", "kill-all-aof"),
    ("redis-maxmemory", "Redis maxmemory below its use (noeviction) 10 s, then lifted", "maxmemory"),
)
ACTIONS = {action for _, _, action in SCENARIOS}
DOCKER_RESTARTS = ("docker-restart", "docker-restart-live")
RECOVER_FROM_START = (*DOCKER_RESTARTS, "kill-all-aof")  # the time down is part of the recovery
TEST_IMAGE = "termpool-test-base:bookworm"  # what the fixture task builds FROM
FSYNC_WINDOW = 1.0  # appendfsync everysec: a write older than this is on disk
FULL_SECONDS = 10.0
RUN_FIELDS = ("state", "host", "task_key", "created_at")  # every run record has them from its first write
JOB_FIELDS = ("state", "kind")


@contextlib.contextmanager
def backdrop(action: str) -> Iterator[tuple[dict, object]]:
    """What a scenario needs around its service: (extra settings, the second daemon or None).
    docker-restart runs its service on a second Docker daemon (devstack/second_docker.py: its
    own data root and socket, a lock other users of it wait on), never the machine's own,
    with the test base image loaded (docker-restart-live: started with --live-restore); the
    daemon and everything in it go at the end."""
    if action not in DOCKER_RESTARTS:
        yield {}, None
        return
    from devstack.second_docker import SecondDocker

    daemon = SecondDocker(args=["--live-restore"] if action == "docker-restart-live" else [])
    try:
        daemon.start()
        daemon.load_image(TEST_IMAGE)
        yield {"DOCKER_HOST": daemon.host}, daemon
    finally:
        daemon.stop()


def inject(action: str, service: Service, daemon) -> dict:
    if action in DOCKER_RESTARTS:
        return restart_docker(daemon)
    if action == "kill-all-aof":
        return crash_with_aof(service)
    return fill_redis(service)


# ---- the Docker daemon restarted ------------------------------------------------------------
def restart_docker(daemon) -> dict:
    """SIGTERM to the second daemon's pid, then its argv again: its containers die unless it
    runs with live-restore. The fault ends when it answers again."""
    if daemon is None:
        return {"action": "none", "error": "docker-restart needs its second daemon"}
    info = daemon.restart()
    info.update(
        action="dockerd SIGTERM + start",
        role="dockerd",
        note=f"dockerd down {info['down_s']} s",
        mark="docker_back",
        mark_at=time.monotonic(),
    )
    return info


# ---- kill -9 of everything, Redis back from its append-only file ----------------------------
def records(client: redis.Redis, pattern: str, tries: int = 3) -> set[str]:
    """Keys of one family (`tp:run:*` is run records, not `tp:run:<id>:jobs`). The harness's
    client does not retry: a connection the restart broke fails once, then a new one is made."""
    for attempt in range(tries):
        try:
            return {key for key in client.scan_iter(match=pattern, count=1000) if key.count(":") == pattern.count(":")}
        except redis.ConnectionError:
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
    return set()


def crash_with_aof(service: Service) -> dict:
    """The run records present FSYNC_WINDOW s (and a little) before a kill -9 of the whole
    stack and its Redis must all be there once serve.sh has relaunched it: appendfsync
    everysec has them on disk. Then restart_stack's relaunch and timings."""
    aof = service.redis.config_get("append*")
    before = records(service.redis, keys.run_key("*"))
    time.sleep(FSYNC_WINDOW + 0.5)
    info = faults.restart_stack(service)
    after = records(service.redis, keys.run_key("*")) if info.get("healthz_s") is not None else set()
    lost = sorted(before - after)
    info.update(
        appendonly=aof.get("appendonly"),
        appendfsync=aof.get("appendfsync"),
        run_records_before=len(before),
        run_records_lost=lost,
    )
    info["note"] = f"{info.get('note', '')}; AOF {aof.get('appendonly')}/{aof.get('appendfsync')}, " + (
        f"{len(lost)} of {len(before)} run records lost"
    )
    return info


# ---- Redis at maxmemory -----------------------------------------------------------------------
def fill_redis(service: Service) -> dict:
    """maxmemory set below what Redis uses (policy noeviction: every write refused, reads and
    deletes go on) for FULL_SECONDS, then the old limit back; then every run and job record
    is checked for the fields it has from its first write (a half-written one is corrupt)."""
    old = service.redis.config_get("maxmemory*")
    used = int(service.redis.info("memory")["used_memory"])
    limit = max(1024 * 1024, used // 2)
    service.redis.config_set("maxmemory-policy", "noeviction")
    service.redis.config_set("maxmemory", limit)
    began = time.monotonic()
    try:
        time.sleep(FULL_SECONDS)
    finally:
        service.redis.config_set("maxmemory", old.get("maxmemory", "0"))
        service.redis.config_set("maxmemory-policy", old.get("maxmemory-policy", "noeviction"))
    ended = time.monotonic()
    corrupt = half_written(service.redis)
    return {
        "action": "CONFIG SET maxmemory, then back",
        "role": "redis",
        "used_bytes": used,
        "maxmemory_bytes": limit,
        "full_s": round(ended - began, 1),
        "half_written": corrupt,
        "note": f"maxmemory {limit // 1024} KB under {used // 1024} KB used, {ended - began:.1f} s; "
        f"{len(corrupt)} half-written records",
        "mark": "limit_lifted",
        "mark_at": ended,
    }


def half_written(client: redis.Redis) -> list[str]:
    """Run and job records missing a field every record has from its first write."""
    found = []
    for pattern, fields in ((keys.run_key("*"), RUN_FIELDS), (keys.job_key("*"), JOB_FIELDS)):
        for key in records(client, pattern):
            values = client.hmget(key, fields)
            if client.exists(key) and any(v is None for v in values):
                found.append(key)
    return sorted(found)
