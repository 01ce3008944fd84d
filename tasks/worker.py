"""Start one worker pool (per queue kind) or the beat scheduler, sized from the settings.

python -m tasks.worker exec        # the exec queue of this host
python -m tasks.worker beat        # the reaper's schedule
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile

from environments import containment
from poolcore.config import QUEUE_KINDS, settings
from poolcore.queues import MAINTENANCE_QUEUE, queue_name
from poolcore.state import LOCK_TTL
from tasks.celery_app import celery_app
from tasks.runtime import store

log = logging.getLogger(__name__)

# Builds are CPU-heavy and rare: processes, so Celery's time limits apply. Everything else
# waits on Docker: threads, so a host can hold hundreds of runs in little memory.
POOLS = {"build": "prefork"}


def node_name(kind: str, host: str, pid: int | None = None) -> str:
    """Unique per process even where every container's pid is 1 (compose replicas)."""
    return f"{kind}-{socket.gethostname()}-{pid or os.getpid()}@{host}"


def worker_argv(kind: str) -> list[str]:
    cfg = settings()
    queues = [queue_name(cfg.host_id, kind)]
    if kind == "teardown":
        queues.append(MAINTENANCE_QUEUE)
    argv = [
        "worker",
        "-Q",
        ",".join(queues),
        "-P",
        POOLS.get(kind, "threads"),
        "-c",
        str(cfg.concurrency[kind]),
        "-n",
        node_name(kind, cfg.host_id),
        "--without-gossip",
        "--without-mingle",
        "-l",
        cfg.log_level,
    ]
    if kind == "build":
        argv += ["--time-limit", str(int(cfg.timeouts.ensure_image) + 60)]
        # A build process grows (Docker connections, memory) with the builds it has run (the
        # soak: docs/soak.md): Celery replaces it with a fresh one after this many, never mid-build.
        if cfg.build_child_max_tasks:
            argv += ["--max-tasks-per-child", str(cfg.build_child_max_tasks)]
    return argv


def beat_argv() -> list[str]:
    schedule = os.path.join(tempfile.gettempdir(), f"termpool-beat-{settings().host_id}")
    return ["beat", "-s", schedule, "-l", settings().log_level]


def hold_beat_lock():
    """Block until this process is the deployment's only beat (a Redis lock, renewed while it
    lives): a second beat started by mistake stands by and takes over when the first dies."""
    lock = store().beat_lock()
    while not lock.acquire(wait=LOCK_TTL):
        log.warning("another beat scheduler runs (%s); standing by", lock.owner())
    return lock


def main(args: list[str]) -> None:
    if len(args) != 1 or args[0] not in (*QUEUE_KINDS, "beat"):
        sys.exit(f"usage: python -m tasks.worker {{{'|'.join(QUEUE_KINDS)}|beat}}")
    if args[0] == "beat":
        logging.basicConfig(level=settings().log_level)
        hold_beat_lock()
    else:
        # Before any job is taken: task containers must not reach this pool's services.
        containment.install(settings())
    celery_app.start(beat_argv() if args[0] == "beat" else worker_argv(args[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
