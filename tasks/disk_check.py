"""The per-run disk limit, checked every DISK_CHECK_SECONDS on each host (beat fans it out to
every live host's teardown queue, as the reconcile sweep is): a started run whose containers'
writable layers, named volumes and run dir hold more than its limit ends with RUN_DISK_LIMIT
and is torn down at once (poolcore/disk.py has the arithmetic, environments/disk_usage.py the
measuring)."""

from __future__ import annotations

import json
import logging

from celery import shared_task

from environments import disk_usage
from poolcore import disk
from poolcore.config import Settings, settings
from poolcore.state import STARTED_STATES
from tasks.runtime import store

log = logging.getLogger(__name__)


@shared_task(name="pool.check_disks_hosts", bind=True)
def check_disks_hosts(self):
    """Beat's fan-out: each live host measures its own runs; a message expires after one
    period, so a host whose teardown queue is stalled gets one pending check, not a backlog."""
    hosts = store().live_hosts()
    for host in hosts:
        self.app.send_task("pool.check_disks", kwargs={"host": host}, expires=settings().disk_check_seconds)
    return hosts


@shared_task(name="pool.check_disks", bind=True)
def check_disks(self, *, host):
    """End this host's started runs that are past their disk limit; returns them."""
    from poolcore.dispatch import enqueue_close  # the same path the facade uses

    layers = disk_usage.host_usage(host)
    ended = []
    runs = store().runs_fields(store().live_runs(host), ("state", "disk_limit", "env"))
    for run_id, run in runs.items():
        limit = run.get("disk_limit") or 0
        if run.get("state") not in STARTED_STATES or not limit:
            continue
        used = run_bytes({**run, "run_id": run_id}, layers)
        if not disk.over_limit(used, limit):
            continue
        if store().end_run(run_id, "RUN_DISK_LIMIT", disk.limit_message(run_id, used, limit)) is not None:
            log.warning("run %s ended: %d bytes on disk, limit %d", run_id, used, limit)
            enqueue_close(self.app, store(), run_id, host)
            ended.append(run_id)
    return ended


def run_bytes(run: dict, layers: dict[str, int]) -> int:
    """A run's bytes: its containers' layers and volumes (its warm container's too, labelled
    with the warm id) and its run dir (the log folders its containers write to)."""
    env = run.get("env") or {}
    used = layers.get(run["run_id"], 0) + (layers.get(env["warm_id"], 0) if env.get("warm_id") else 0)
    if env.get("run_dir"):
        used += disk_usage.folder_bytes(env["run_dir"], follow_top_links=True)
    return used


def host_facts(cfg: Settings) -> dict:
    """What a host publishes about its disks with each heartbeat (host:<h>:info): free space
    of Docker's data root and the output root, why it takes no new runs ('' when it has room:
    the placement script skips a host whose disk_low is set) and whether the storage driver
    enforces a size per container. A failed measure publishes room, as before this existed."""
    try:
        spaces = disk_usage.spaces(cfg.output_root)
    except OSError:
        log.warning("could not measure free disk space", exc_info=True)
        return {"disk_low": ""}
    return {
        "disk_low": disk.shortage(spaces, cfg.host_disk_min_free),
        "disk": json.dumps([space.__dict__ for space in spaces]),
        "storage_quota": disk_usage.storage_quota(),
    }
