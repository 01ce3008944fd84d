"""Run Flower, Celery's web monitor, against termpool's Celery app.

    python -m jobs.flower          # the Procfile's `flower` process

Flower sees every worker pool and queue of every host through the broker (REDIS_URL), and
each pool task by name with its arguments; the `kwargs` column carries the run id (the
facade sends a short `kwargsrepr` with host, run_id and job_id first).

Settings, from the environment:
    FLOWER_PORT          port to serve on (default 5555)
    FLOWER_BASIC_AUTH    `user:password` (several: comma-separated); Flower's HTTP API answers
                         only when it is set
    FLOWER_ADDRESS       interface to bind (default all when FLOWER_BASIC_AUTH is set, else
                         127.0.0.1: no unauthenticated monitor on the network by default)
    FLOWER_MAX_TASKS     finished tasks kept in memory (default 10000: about 20 MB)
    FLOWER_PURGE_OFFLINE_WORKERS  seconds after which an offline worker is dropped from the
                         dashboard (default 3600: restarted worker pools get new names)
Any other FLOWER_<OPTION> variable reaches Flower as usual (e.g. FLOWER_URL_PREFIX).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("termpool.flower")

DEFAULT_PORT = 5555
DEFAULT_MAX_TASKS = 10_000
DEFAULT_PURGE_OFFLINE = 3600
TASK_COLUMNS = "name,uuid,state,kwargs,received,started,runtime,worker"
# The variables this launcher turns into arguments itself.
OWN_VARIABLES = (
    "FLOWER_PORT",
    "FLOWER_ADDRESS",
    "FLOWER_BASIC_AUTH",
    "FLOWER_MAX_TASKS",
    "FLOWER_PURGE_OFFLINE_WORKERS",
)


def _int(env, name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name} must be an integer, not {raw!r}") from None
    if value < 0:
        raise SystemExit(f"{name} must not be negative")
    return value


def check_basic_auth(value: str) -> list[str]:
    """The `user:password` pairs of FLOWER_BASIC_AUTH; exits on a malformed one."""
    pairs = [pair.strip() for pair in value.split(",") if pair.strip()]
    for pair in pairs:
        user, sep, password = pair.partition(":")
        if not sep or not user or not password:
            raise SystemExit("FLOWER_BASIC_AUTH must be user:password (several: comma-separated)")
    return pairs


def flower_argv(basic_auth: str, env=None) -> list[str]:
    """The arguments of `celery flower` for these settings."""
    env = os.environ if env is None else env
    pairs = check_basic_auth(basic_auth) if basic_auth else []
    address = env.get("FLOWER_ADDRESS", "").strip() or ("0.0.0.0" if pairs else "127.0.0.1")
    argv = [
        "flower",
        f"--port={_int(env, 'FLOWER_PORT', DEFAULT_PORT)}",
        f"--address={address}",
        f"--max_tasks={_int(env, 'FLOWER_MAX_TASKS', DEFAULT_MAX_TASKS)}",
        f"--purge_offline_workers={_int(env, 'FLOWER_PURGE_OFFLINE_WORKERS', DEFAULT_PURGE_OFFLINE)}",
    ]
    if not env.get("FLOWER_TASKS_COLUMNS", "").strip():
        argv.append(f"--tasks_columns={TASK_COLUMNS}")
    if pairs:
        argv.append(f"--basic_auth={','.join(pairs)}")
    return argv


def main() -> None:
    from jobs.celery_app import celery_app
    from termpool.config import settings

    logging.basicConfig(level=settings().log_level, format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    argv = flower_argv(settings().flower_basic_auth)
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
    sys.exit(celery_app.start(argv) or 0)


if __name__ == "__main__":
    main()
