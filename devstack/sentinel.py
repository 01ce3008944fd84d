"""A Redis Sentinel deployment as real processes on this machine: a primary, a replica and three
sentinels on free ports, each with a folder of its own, started and killed by pid. For the
Sentinel test and the chaos suite's failover scenario; `Stack(redis_group=...)` runs termpool
on it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from devstack.stack import free_port

MASTER_NAME = "termpool"
DOWN_AFTER_MS = 1000  # a primary silent this long is down for a sentinel
FAILOVER_TIMEOUT_MS = 5000  # a stuck failover is tried again after twice this


class SentinelGroup:
    """Primary, replica and sentinels of a Sentinel deployment. Both data nodes keep an
    append-only file fsynced every second, as the deployments run Redis."""

    def __init__(self, workdir: Path, replicas: int = 1, sentinels: int = 3):
        self.workdir = Path(workdir) / "redis-ha"
        self.ports = [free_port() for _ in range(1 + replicas)]  # the first starts as the primary
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.procs: dict[str, subprocess.Popen] = {}

    # ---- what termpool is given -------------------------------------------------------------
    def settings_env(self) -> dict:
        return {
            "REDIS_SENTINELS": ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports),
            "REDIS_SENTINEL_MASTER": MASTER_NAME,
        }

    # ---- processes ----------------------------------------------------------------------------
    def start(self) -> SentinelGroup:
        try:
            for index, port in enumerate(self.ports):
                replica_of = [] if index == 0 else ["--replicaof", "127.0.0.1", str(self.ports[0])]
                self._spawn(f"redis-{port}", self._node_argv(port) + replica_of)
            for port in self.ports:
                self._wait(lambda p=port: self.node(p).ping(), f"redis on {port}")
            self._wait(lambda: self.node(self.ports[0]).info("replication")["connected_slaves"] == len(self.ports) - 1)
            for port in self.sentinel_ports:
                self._spawn(f"sentinel-{port}", ["redis-server", str(self._sentinel_conf(port)), "--sentinel"])
            self._wait(lambda: all(self.sentinels_known(p) for p in self.sentinel_ports), "sentinels", 60)
        except BaseException:
            self.stop()
            raise
        return self

    def _node_argv(self, port: int) -> list[str]:
        folder = self.workdir / f"node-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        return [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
        ]

    def _sentinel_conf(self, port: int) -> Path:
        """A sentinel rewrites its own configuration file: one per sentinel, in its folder."""
        folder = self.workdir / f"sentinel-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.ports[0]} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        return conf

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child's stdout: it outlives this call)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # nothing to keep: the folders are temporary
        for proc in self.procs.values():
            proc.wait(timeout=30)
        self.procs.clear()

    # ---- looking and failing ------------------------------------------------------------------
    def node(self, port: int, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout)

    def sentinels_known(self, port: int) -> bool:
        """The sentinel on `port` sees the primary, its replicas and the two other sentinels."""
        master = self.node(port).sentinel_master(MASTER_NAME)
        return (
            master["num-slaves"] == len(self.ports) - 1
            and master["num-other-sentinels"] == len(self.sentinel_ports) - 1
        )

    def primary_port(self) -> int:
        """The port of the primary as the sentinels name it now (the first that answers)."""
        for port in self.sentinel_ports:
            try:
                return int(self.node(port).sentinel_get_master_addr_by_name(MASTER_NAME)[1])
            except (redis.RedisError, TypeError):
                continue
        raise RuntimeError("no sentinel answers")

    def kill_primary(self) -> int:
        """kill -9 of the primary's redis-server; its port."""
        port = self.primary_port()
        proc = self.procs.pop(f"redis-{port}")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return port

    def wait_failover(self, old_port: int, timeout: float = 60) -> float:
        """Seconds until every sentinel names a new primary that answers as one."""

        def promoted() -> bool:
            named = {int(self.node(p).sentinel_get_master_addr_by_name(MASTER_NAME)[1]) for p in self.sentinel_ports}
            return (
                len(named) == 1
                and old_port not in named
                and self.node(named.pop()).info("replication")["role"] == "master"
            )

        start = time.monotonic()
        self._wait(promoted, "failover", timeout)
        return time.monotonic() - start

    def _wait(self, check, what: str = "redis", timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (redis.RedisError, KeyError, TypeError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{what} did not come up; logs in {self.workdir}")
