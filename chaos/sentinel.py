"""The `sentinel-failover` scenario: the service on a Redis Sentinel deployment (a primary, a
replica, three sentinels: devstack/sentinel.py) loses its primary to kill -9 mid-episodes.

SentinelService is the chaos Service with that deployment in place of serve.sh's own Redis
(REDIS_SENTINELS set: scripts/start-backends.sh starts none); `fail_over` is the fault. Before
the kill it measures how far the replica trails the primary under the episodes' load: the
window of acknowledged writes a failover can lose (docs/operations.md).
"""

from __future__ import annotations

import statistics
import time

import redis

from chaos.service import Service
from devstack.sentinel import SentinelGroup
from poolcore.config import load_settings
from poolcore.state import connection

LAG_SAMPLES = 40  # replication samples before the kill, LAG_INTERVAL apart
LAG_INTERVAL = 0.05


class SentinelService(Service):
    def __init__(self, workdir, env: dict | None = None):
        self.group = SentinelGroup(workdir)
        super().__init__(workdir, {**self.group.settings_env(), **(env or {})})

    def start(self) -> None:
        self.group.start()
        # The harness's client follows the primary, as the service's do.
        self.redis = connection.client(load_settings(self.env), timeout=5)
        super().start()

    def stop_redis(self) -> None:
        self.group.stop()

    def redis_pid(self) -> None:
        return None  # the Redis servers are the group's processes, not the service's


def replication_lag(group: SentinelGroup) -> dict:
    """Under load: how many bytes of the primary's replication stream the replica had not yet
    acknowledged (a replica acknowledges once a second unless asked: an upper bound), and how
    long a write takes to be on the replica (a write, then WAIT 1, which asks at once)."""
    primary = group.node(group.primary_port())
    behind, waits = [], []
    for i in range(LAG_SAMPLES):
        info = primary.info("replication")
        behind.append(info["master_repl_offset"] - info["slave0"]["offset"])
        start = time.monotonic()
        primary.set("chaos:lag-probe", i)
        if primary.wait(1, 1000) == 1:
            waits.append((time.monotonic() - start) * 1000)
        time.sleep(LAG_INTERVAL)
    primary.delete("chaos:lag-probe")
    return {
        "replica_behind_bytes_median": statistics.median(behind),
        "replica_behind_bytes_max": max(behind),
        "write_to_replica_ack_ms_median": round(statistics.median(waits), 2) if waits else None,
        "write_to_replica_ack_ms_max": round(max(waits), 2) if waits else None,
    }


def fail_over(service: SentinelService) -> dict:
    """kill -9 of the primary's redis-server; returns once every sentinel names the replica."""
    group = service.group
    info: dict = {"action": "kill -9 Redis primary (Sentinel)"}
    try:
        info.update(replication_lag(group))
    except (redis.RedisError, KeyError) as exc:  # a figure missing, the fault still happens
        info["lag_error"] = f"{type(exc).__name__}: {exc}"
    port = group.primary_port()
    info["pid"] = group.procs[f"redis-{port}"].pid
    info["hit_at"] = time.monotonic()  # recovery is timed from the kill, not from the measuring
    group.kill_primary()
    info["failover_s"] = round(group.wait_failover(port), 2)
    info.update(old_primary_port=port, new_primary_port=group.primary_port())
    info.update(mark="failover", mark_at=time.monotonic())
    info["note"] = f"pid {info['pid']}; every sentinel named the replica {info['failover_s']:g} s after the kill"
    if "write_to_replica_ack_ms_median" in info:
        info["note"] += (
            f"; before it a write was on the replica in {info['write_to_replica_ack_ms_median']} ms median,"
            f" {info['write_to_replica_ack_ms_max']} ms max (WAIT 1)"
        )
    return info
