"""A pool-wide prebuild's jobs (cli/prebuild.py sends them): one task's images on one host.

Each runs on its host's build queue, through the same code a run's image step runs
(environments/task_builds.py) under the same locks, and answers in Redis (Store.prebuild_done):
Celery keeps no results in this pool.
"""

from __future__ import annotations

import functools
import time

from celery import shared_task

from environments import task_builds
from environments.docker_client import MAX_OUTPUT
from poolcore.config import settings
from poolcore.failures import TaskBuildFailed
from poolcore.uploaded_tasks import docker_task_name
from tasks import task_folders
from tasks.runtime import store


@shared_task(name="pool.prebuild_task", bind=True, acks_late=True)
def prebuild_task(self, *, host, batch, task_path, timeout):
    """Make sure this host has the task's images; the result goes to the batch's report."""
    cfg, started = settings(), time.monotonic()
    result = {"status": "failed", "image": "", "error": ""}
    try:
        task_dir = task_folders.task_dir(task_path)
        name = docker_task_name({"task_path": task_path, "task_name": task_dir.name})  # as the CLI's own
        lock = functools.partial(store().build_lock, cfg.host_id)
        made = task_builds.ensure_images(name, task_dir, cfg, timeout, lock, store())
        result["image"], result["status"] = made
        store().mark_image_ready(host, task_path)
    except TaskBuildFailed as exc:  # the build log's tail is in its text
        result["error"] = str(exc)[-MAX_OUTPUT:]
    except Exception as exc:  # one task's failure is a row of the report, not the end of it
        result["error"] = f"{type(exc).__name__}: {exc}"[-MAX_OUTPUT:]
    result["seconds"] = round(time.monotonic() - started, 1)
    store().prebuild_done(batch, host, task_path, result)
    return result["status"]
