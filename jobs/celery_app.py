"""The workers' Celery application: termpool/queues.py's app, with the job modules and the
beat schedule (reaping idle runs, sweeping each host for leftovers)."""

from __future__ import annotations

from termpool.config import settings
from termpool.queues import make_celery

RECONCILE_SECONDS = 30.0
# What a worker imports: its jobs, and the signal handlers that notice lost work.
JOB_MODULES = ["jobs.run_jobs", "jobs.warm_pool", "jobs.maintenance", "jobs.episode", "jobs.lost_jobs"]

BEAT_SCHEDULE = {
    "reap-idle-runs": {"task": "pool.reap", "schedule": 10.0},
    # Leftovers of runs Redis no longer knows go within a minute, not at the next
    # worker start: the fan-out sends pool.reconcile to each live host's teardown queue.
    "reconcile-hosts": {"task": "pool.reconcile_hosts", "schedule": RECONCILE_SECONDS},
}

celery_app = make_celery(settings(), include=JOB_MODULES)
celery_app.conf.beat_schedule = BEAT_SCHEDULE
