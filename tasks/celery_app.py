"""The workers' Celery application: poolcore/queues.py's app, with the job modules and the
beat schedule (reaping idle runs, sweeping each host for leftovers, sizing warm pools,
reclaiming the pool registry's storage)."""

from __future__ import annotations

from celery.signals import worker_process_init, worker_ready

from poolcore.config import settings
from poolcore.queues import follow_monitor, make_celery
from poolcore.state import Store
from tasks.registry_jobs import RECLAIM_SECONDS
from tasks.warm_pool import SIZE_SECONDS

RECONCILE_SECONDS = 30.0
# What a worker imports: its jobs, and the signal handlers that notice lost work.
JOB_MODULES = [
    "tasks.run_jobs",
    "tasks.command_jobs",
    "tasks.fork_jobs",
    "tasks.archive_jobs",
    "tasks.warm_pool",
    "tasks.maintenance",
    "tasks.disk_check",
    "tasks.episode",
    "tasks.lost_jobs",
    "tasks.prebuild_jobs",
    "tasks.registry_jobs",
]

BEAT_SCHEDULE = {
    # The pool registry's storage: images no host used for REGISTRY_RETENTION_DAYS go.
    "reclaim-registry": {"task": "pool.reclaim_registry", "schedule": RECLAIM_SECONDS},
    "reap-idle-runs": {"task": "pool.reap", "schedule": 10.0},
    # Leftovers of runs Redis no longer knows go within a minute, not at the next
    # worker start: the fan-out sends pool.reconcile to each live host's teardown queue.
    "reconcile-hosts": {"task": "pool.reconcile_hosts", "schedule": RECONCILE_SECONDS},
    # Warm pools shrink when demand stops and never keep a spare past WARM_IDLE_TTL.
    "size-warm-pools": {"task": "pool.size_warm_hosts", "schedule": SIZE_SECONDS},
}

if settings().disk_check_seconds > 0:  # runs past their disk limit end within one period
    BEAT_SCHEDULE["check-run-disks"] = {"task": "pool.check_disks_hosts", "schedule": settings().disk_check_seconds}

celery_app = make_celery(settings(), include=JOB_MODULES)
celery_app.conf.beat_schedule = BEAT_SCHEDULE


@worker_ready.connect
def _follow_monitor(**_):
    """Jobs send their chain's next step, and thread pools send from this process."""
    follow_monitor(celery_app, settings(), Store.connect(settings(), timeout=5, wait_out=False))


@worker_process_init.connect
def _follow_monitor_in_child(**_):
    """A prefork child (the build pool) sends its chain's next step itself."""
    _follow_monitor()
