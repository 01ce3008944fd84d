"""Run Flower, Celery's web monitor, against termpool's Celery app.

    python -m tasks.flower          # the Procfile's `flower` process

Flower sees every worker pool and queue of every host through the broker (REDIS_URL), and
each pool task by name with its arguments; the `kwargs` column carries the run id (the
facade sends a short `kwargsrepr` with host, run_id and job_id first).

Settings (read by poolcore/config.py; docs/settings.md):
    FLOWER_PORT          port to serve on (default 5555)
    FLOWER_BASIC_AUTH    `user:password` (several: comma-separated); Flower's HTTP API answers
                         only when it is set
    FLOWER_ADDRESS       interface to bind (default all when FLOWER_BASIC_AUTH is set, else
                         127.0.0.1: no unauthenticated monitor on the network by default)
    FLOWER_MAX_TASKS     finished tasks kept in memory (default 10000: about 20 MB)
    FLOWER_PURGE_OFFLINE_WORKERS  seconds after which an offline worker is dropped from the
                         dashboard (default 3600: restarted worker pools get new names)
    FLOWER_TASKS_COLUMNS the task table's columns (default: config.FLOWER_TASK_COLUMNS, with kwargs)
Any other FLOWER_<OPTION> variable reaches Flower as usual (e.g. FLOWER_URL_PREFIX).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from poolcore.config import Settings, settings

log = logging.getLogger("termpool.flower")

# The variables this launcher turns into arguments itself (from Settings).
OWN_VARIABLES = (
    "FLOWER_PORT",
    "FLOWER_ADDRESS",
    "FLOWER_BASIC_AUTH",
    "FLOWER_MAX_TASKS",
    "FLOWER_PURGE_OFFLINE_WORKERS",
    "FLOWER_TASKS_COLUMNS",
)


def check_basic_auth(value: str) -> list[str]:
    """The `user:password` pairs of FLOWER_BASIC_AUTH; exits on a malformed one."""
    pairs = [pair.strip() for pair in value.split(",") if pair.strip()]
    for pair in pairs:
        user, sep, password = pair.partition(":")
        if not sep or not user or not password:
            raise SystemExit("FLOWER_BASIC_AUTH must be user:password (several: comma-separated)")
    return pairs


def flower_argv(cfg: Settings) -> list[str]:
    """The arguments of `celery flower` for these settings."""
    pairs = check_basic_auth(cfg.flower_basic_auth) if cfg.flower_basic_auth else []
    argv = [
        "flower",
        f"--port={cfg.flower_port}",
        f"--address={cfg.flower_address or ('0.0.0.0' if pairs else '127.0.0.1')}",
        f"--max_tasks={cfg.flower_max_tasks}",
        f"--purge_offline_workers={cfg.flower_purge_offline_workers}",
        f"--tasks_columns={cfg.flower_tasks_columns}",
    ]
    if pairs:
        argv.append(f"--basic_auth={','.join(pairs)}")
    return argv


def announce_monitor() -> None:
    """Say in the state store, while Flower runs, that a monitor listens: with TASK_EVENTS=monitor
    task-sent events are published only then (poolcore/queues.py follow_monitor)."""
    from poolcore.queues import MONITOR_POLL
    from poolcore.state import Store

    store = Store.connect(settings())

    def announce() -> None:
        while True:
            try:
                store.announce_monitor(ttl=3 * MONITOR_POLL)
            except Exception as exc:  # Redis away: Flower itself reconnects; so do we
                log.warning("could not announce the monitor: %s", exc)
            time.sleep(MONITOR_POLL)

    threading.Thread(target=announce, daemon=True, name="termpool-monitor-announce").start()


def main() -> None:
    from tasks.celery_app import celery_app

    logging.basicConfig(level=settings().log_level, format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    argv = flower_argv(settings())
    # Flower reads FLOWER_<OPTION> variables itself and fails on empty ones (docker-compose.yml
    # passes unset settings as empty): the arguments above stand for ours, drop empty others.
    for name in [n for n in os.environ if n.startswith("FLOWER_")]:
        if name in OWN_VARIABLES or not os.environ[name].strip():
            del os.environ[name]
    if not any(a.startswith("--basic_auth=") for a in argv):
        log.warning(
            "FLOWER_BASIC_AUTH is not set: Flower's pages are open to anyone who reaches %s, and its HTTP API is off",
            next(a for a in argv if a.startswith("--address=")).split("=", 1)[1],
        )
    announce_monitor()
    sys.exit(celery_app.start(argv) or 0)


if __name__ == "__main__":
    main()
