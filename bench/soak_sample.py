"""One sample of everything a long-running host could accumulate (bench/soak.py takes one every
few hundred episodes): Redis memory and keys by family, each termpool process's RSS and open
file descriptors, Docker's objects, and the disk under the stack's folders.

Key families follow termpool/state's docstring: the prefix, the family's first word, and the
suffix words of its per-id keys (`tp:run:<id>:jobs` -> `run:*:jobs`); kombu's keys (Celery's
broker) are grouped with the stack's host id replaced by `<h>`. Docker objects are counted
twice: those labelled with the stack's host id (its own) and the daemon's totals (the machine
is shared, so totals move with other users' work too).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from bench.monitor import Monitor
from environments.docker_client import HOST_LABEL, TASK_IMAGE_LABEL
from poolcore.config import QUEUE_KINDS
from poolcore.queues import queue_name
from poolcore.state import PREFIX, Store

MB = 1024 * 1024
# The words after an id that name a per-id key family (poolcore/state/__init__.py).
SUFFIXES = {"jobs", "working", "done", "keys", "live", "closing", "workers", "nodes", "info", "lost"}
SUFFIXES |= {"subnets", "subnet-owners", "run-folders"}
# Fixed keys: their whole name is their family.
FIXED = {"runs:recent", "hosts", "hosts:draining", "hosts:lost", "beat-lock", "count:failures"}
FIXED |= {"count:retries", "monitor"}


def key_family(key: str, host_id: str) -> str:
    """The family a Redis key belongs to, its ids replaced by `*` (kombu's: host id by `<h>`)."""
    if not key.startswith(PREFIX):
        return "kombu:" + re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "*", key.replace(host_id, "<h>"))
    rest = key[len(PREFIX) :]
    if rest in FIXED:
        return rest
    parts = rest.split(":")
    if parts[0] == "blob" and len(parts) > 2:  # blob:task-facts:<hex>, blob:task:<hex>: kinds of blobs
        return f"blob:{parts[1]}:*"
    tail = [":" + part for part in parts[2:] if part in SUFFIXES]
    return parts[0] + (":*" if len(parts) > 1 else "") + "".join(tail)


def redis_figures(redis_client, host_id: str) -> dict:
    families: dict[str, int] = {}
    for key in redis_client.scan_iter(count=1000):
        family = key_family(key, host_id)
        families[family] = families.get(family, 0) + 1
    info = redis_client.info("memory")
    store = Store(redis_client)
    depths = store.queue_depths([queue_name(host_id, kind) for kind in QUEUE_KINDS])
    return {
        "used_memory_mb": round(info["used_memory"] / MB, 3),
        "keys": sum(families.values()),
        "keys_by_family": dict(sorted(families.items())),
        # Work waiting: a queue that only grows is a backlog the host does not keep up with.
        "queued": {kind: depths[queue_name(host_id, kind)] for kind in QUEUE_KINDS},
        "pending_closes": len(store.closing_runs(host_id)),
    }


def docker_figures(client, host_id: str) -> dict:
    mine = {"label": f"{HOST_LABEL}={host_id}"}
    images = client.api.images(all=False)
    return {
        "containers": len(client.api.containers(all=True, filters=mine)),
        "networks": len(client.api.networks(filters=mine)),
        "volumes": len((client.api.volumes(filters=mine) or {}).get("Volumes") or []),
        "task_images": len(client.api.images(filters={"label": f"{TASK_IMAGE_LABEL}={host_id}"})),
        "total_containers": len(client.api.containers(all=True)),
        "total_networks": len(client.api.networks()),
        "total_volumes": len((client.api.volumes() or {}).get("Volumes") or []),
        "total_images": len(images),
        "total_dangling_images": len(client.api.images(filters={"dangling": True})),
    }


def folder_figures(path: Path) -> dict:
    """Bytes (allocated, as du counts) and entries under a folder; zero when it is not there."""
    size, entries = 0, 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            entries += 1
            try:
                size += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # removed while walking: a teardown or a prune
    return {"mb": round(size / MB, 3), "entries": entries}


def log_figures(workdir: Path) -> dict:
    logs = [p for p in workdir.glob("*.log") if p.is_file()]
    return {"mb": round(sum(p.stat().st_size for p in logs) / MB, 3), "entries": len(logs)}


class Sampler:
    """Samples of one stack (devstack.Stack) and the Docker daemon, with the folders it writes."""

    def __init__(self, stack, docker, socket_dir: Path):
        self.stack = stack
        self.docker = docker
        self.folders = {
            "output": stack.output_root,
            "sockets": socket_dir,
            "uploaded_tasks": Path(stack.env["UPLOADED_TASKS_DIR"]),
        }
        self.processes = Monitor(stack.procs, stack.url)  # its readings only: its thread is not started

    def sample(self, episodes: int, phase: str) -> dict:
        rss = self.processes.rss_by_kind()
        fds = self.processes.fds_by_kind()
        return {
            "episodes": episodes,
            "phase": phase,
            "t": round(time.time(), 1),
            "redis": redis_figures(self.stack.redis, self.stack.host_id),
            "rss_mb": {kind: round(mb, 1) for kind, mb in sorted(rss.items())},
            "fds": {kind: int(n) for kind, n in sorted(fds.items())},
            "docker": docker_figures(self.docker, self.stack.host_id),
            "disk": {
                **{name: folder_figures(path) for name, path in self.folders.items()},
                "logs": log_figures(self.stack.workdir),
            },
        }

    def close(self) -> None:
        self.processes.stop()
