"""Maintenance: the idle reaper (beat), the reconcile sweep (at worker start and every
RECONCILE_SECONDS from beat), and worker liveness heartbeats."""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown

from environments import lifecycle
from jobs.runtime import store
from termpool.config import settings

log = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 5.0


def _run_is_live(run_id: str) -> bool:
    if run_id.startswith("warm-"):
        return store().warm_known(run_id)
    run = store().get_run(run_id) if run_id else None
    return bool(run) and run.get("state") != "closed"


@shared_task(name="pool.reconcile", bind=True)
def reconcile(self, *, host):
    removed = lifecycle.reconcile(host, _run_is_live, settings().socket_dir)
    if removed:
        log.warning("reconcile removed leftovers of runs %s", removed)
    return removed


@shared_task(name="pool.reconcile_hosts", bind=True)
def reconcile_hosts(self):
    """Beat's periodic sweep: ask every live host to reconcile its own Docker.

    Each message expires after one period, so a host whose teardown queue is stalled gets
    one pending sweep, not a backlog.
    """
    from jobs.celery_app import RECONCILE_SECONDS

    hosts = store().live_hosts()
    for host in hosts:
        self.app.send_task("pool.reconcile", kwargs={"host": host}, expires=RECONCILE_SECONDS)
    return hosts


@shared_task(name="pool.reap", bind=True)
def reap(self):
    """Release idle runs and leases never reset, queue their teardown; re-queue teardowns
    that were lost."""
    from termpool.dispatch import enqueue_close  # the same path the facade uses

    cfg = settings()
    hosts = set(store().live_hosts()) | {cfg.host_id}
    reaped = []
    for host in hosts:
        # An /allocate never followed by a reset holds a slot; heartbeats do not extend it.
        candidates = [(run_id, "idle", "") for run_id in store().idle_runs(host, cfg.run_idle_ttl)]
        candidates += [
            (run_id, "never_reset", "allocated") for run_id in store().never_reset_runs(host, cfg.allocated_ttl)
        ]
        for run_id, reason, only_state in candidates:
            if store().release(run_id, reason=reason, only_state=only_state):
                enqueue_close(self.app, store(), run_id, host)
                reaped.append(run_id)
        for run_id in store().stale_closing_runs(host, cfg.timeouts.close_session * 2):
            enqueue_close(self.app, store(), run_id, host)
    return reaped


# ---- worker liveness ------------------------------------------------------------------------
def _heartbeat(node: str, host: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            store().node_heartbeat(node)
            store().host_heartbeat(host)
        except Exception:  # Redis away: keep trying, the facade reports 503 meanwhile
            log.exception("heartbeat failed")
        stop.wait(HEARTBEAT_SECONDS)


_stop_heartbeat = threading.Event()


@worker_ready.connect
def _on_worker_ready(sender=None, **_):
    node = sender.hostname
    threading.Thread(
        target=_heartbeat, args=(node, settings().host_id, _stop_heartbeat), daemon=True, name="termpool-heartbeat"
    ).start()
    sender.app.send_task("pool.reconcile", kwargs={"host": settings().host_id})


@worker_shutdown.connect
def _on_worker_shutdown(**_):
    _stop_heartbeat.set()
