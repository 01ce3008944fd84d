"""Maintenance: the idle reaper (beat), the reconcile sweep (at worker start and every
RECONCILE_SECONDS from beat), lost hosts (beat, poolcore/hosts.py), and worker liveness
heartbeats (with the host's queue kind and capacity)."""

from __future__ import annotations

import functools
import logging
import threading

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown

from environments import disk_usage, forking, lifecycle, networks, pool_images, task_images
from environments.docker_client import docker_client
from poolcore import hosts
from poolcore.config import settings
from poolcore.dispatch import enqueue_close
from poolcore.queues import consumed_kinds
from poolcore.state import RESERVED, STARTED_STATES, Store
from tasks import close_recovery, disk_check, fork_jobs, image_budget, run_folders, task_folders
from tasks.runtime import store

log = logging.getLogger(__name__)


def _run_is_live(run_id: str) -> bool:
    if run_id.startswith("warm-"):
        return store().warm_known(run_id)
    state = store().run_state(run_id)  # its state alone: the reconcile asks for each resource
    return state is not None and state not in ("closed", "lost")


LOST_SHOWN_SECONDS = 30.0  # a lost run answers HOST_LOST at least this long before its host closes it


@shared_task(name="pool.reconcile", bind=True)
def reconcile(self, *, host, at_start=False):
    """Remove this host's leftovers; runs marked lost while it was away are closed first (once
    their callers have had LOST_SHOWN_SECONDS of HOST_LOST). At a worker's start, runs whose containers
    died with the host's previous incarnation become lost."""
    settled = store().settle_lost_runs(host, older_than=LOST_SHOWN_SECONDS)
    if settled:
        log.warning("host %s is back: closing its %d runs marked lost", host, len(settled))
    if at_start:
        _lose_runs_without_containers(host)
        _reserve_foreign_subnets(host)
    else:  # the engine may have been restarted with another live-restore setting since
        _note_live_restore(host)
    stale = fork_jobs.close_stale_forks(host, lambda run_id: enqueue_close(self.app, store(), run_id, host))
    if stale:
        log.warning("closing children of forks that never ended: %s", stale)
    removed = lifecycle.reconcile(host, _run_is_live, settings().socket_dir)
    if removed:
        log.warning("reconcile removed leftovers of runs %s", removed)
    freed = _give_back_orphan_subnets(host)
    if freed:
        log.warning("reconcile gave back the network blocks of runs no longer live: %s", freed)
    images = fork_jobs.remove_orphan_images(host, _run_is_live)
    if images:
        log.warning("reconcile removed fork images no run needs: %s", images)
    # After the fork images: a task image a removed fork image was committed from goes too.
    replaced = task_images.remove_unused(host, functools.partial(store().build_lock, host))
    if replaced:
        log.warning("reconcile removed replaced task images no container uses: %s", replaced)
    checkpoints = fork_jobs.remove_stale_checkpoints(host)
    if checkpoints:
        log.warning("reconcile removed checkpoints of forks that never ended: %s", checkpoints)
    live_tasks = _live_task_paths(host)
    folders = task_folders.remove_expired(live_tasks)
    if folders:
        log.info("reconcile removed uploaded task folders whose upload expired: %s", folders)
    uploads = task_folders.remove_expired_images(host, live_tasks)
    if uploads:
        log.info("reconcile removed the images of uploaded tasks whose upload expired: %s", uploads)
    pruned = run_folders.prune(host)
    if pruned:
        log.info("reconcile removed %d run folders older than RUN_FOLDER_TTL", len(pruned))
    late = pool_images.upkeep(settings(), store(), host)
    if late:
        log.info("reconcile pushed to the pool's registry what a build could not: %s", late)
    # Last: the images of replaced tasks, ended forks and expired uploads have gone first.
    beyond = image_budget.keep_within_budget(host, live_tasks)
    if beyond:
        log.warning("reconcile removed least recently used task images beyond IMAGE_DISK_BUDGET: %s", beyond)
    return removed


def _live_task_paths(host: str) -> set[str]:
    """The task paths the host's live runs name (their folders stay)."""
    runs = store().runs_fields(store().live_runs(host), ("task_meta",)).values()
    return {(run.get("task_meta") or {}).get("task_path") or "" for run in runs}


def _give_back_orphan_subnets(host: str) -> list[str]:
    """Blocks of runs that are gone (a teardown cut short between removing the networks and
    giving them back, a start that died): their networks were removed just before, by
    lifecycle.reconcile, so the blocks are free."""
    gone = [owner for owner in store().subnet_owners(host) if owner != RESERVED and not _run_is_live(owner)]
    for owner in gone:
        store().give_back_subnets(host, owner)
    return gone


def _reserve_foreign_subnets(host: str) -> None:
    """At a worker's start: the blocks of RUN_SUBNETS that a route or a network Docker made
    itself already uses are reserved (never given to a run), each clash logged."""
    blocks = settings().run_subnets
    clashes = {}
    for cidr, what in networks.foreign_subnets(host):
        for index in blocks.overlapping([cidr]):
            clashes.setdefault(index, what)
    reserved = store().reserve_subnets(host, set(clashes))
    for what in sorted({clashes[i] for i in reserved}):
        log.error("RUN_SUBNETS %s overlaps %s: its blocks there are not used", blocks.cidr, what)
    free, runs = blocks.count - len(reserved), settings().max_tasks * settings().max_runs_per_task
    if free < runs:  # a run takes a block per network: fewer blocks than runs caps the host below its capacity
        log.warning(
            "RUN_SUBNETS %s has %d free /%d blocks for up to %d live runs: widen it or lengthen RUN_SUBNET_PREFIX",
            blocks.cidr,
            free,
            blocks.prefix,
            runs,
        )


def _lose_runs_without_containers(host: str) -> None:
    """A crash or reboot took these runs' containers (a restart of only termpool's processes
    leaves them running, and their runs go on): calls on them answer HOST_LOST from now on."""
    running = lifecycle.running_containers(host)
    for run_id in store().live_runs(host):
        run = store().get_run(run_id) or {}
        client = (run.get("env") or {}).get("client")
        # Asked again one by one: a run started since the listing is ready and running now.
        if run.get("state") in STARTED_STATES and client and client not in running and not lifecycle.is_running(client):
            error = f"run {run_id} died with its worker host {host}: its container {client} no longer runs"
            if store().mark_run_lost(run_id, error, STARTED_STATES):
                log.warning("%s", error)


@shared_task(name="pool.reconcile_hosts", bind=True)
def reconcile_hosts(self):
    """Beat's periodic sweep: ask every live host to reconcile its own Docker.

    Each message expires after one period, so a host whose teardown queue is stalled gets
    one pending sweep, not a backlog.
    """
    from tasks.celery_app import RECONCILE_SECONDS

    hosts = store().live_hosts()
    for host in hosts:
        self.app.send_task("pool.reconcile", kwargs={"host": host}, expires=RECONCILE_SECONDS)
    return hosts


@shared_task(name="pool.reap", bind=True)
def reap(self):
    """Release idle runs and leases never reset, queue their teardown; re-queue teardowns
    that were lost."""

    cfg = settings()
    lost = hosts.sweep(store(), hosts.process_watch())
    if lost:
        log.warning("runs marked lost (HOST_LOST), by host: %s", lost)
    reaped = []
    for host in set(store().live_hosts()) | {cfg.host_id}:
        # A run with a job working (a call of any length, an evaluation, a fork) is not idle;
        # an /allocate never followed by a reset holds a slot, and heartbeats do not extend it.
        released = [
            r for r in store().idle_runs(host, cfg.run_idle_ttl) if store().release_if_idle(r, cfg.run_idle_ttl)
        ]
        for run_id in store().never_reset_runs(host, cfg.allocated_ttl):
            if store().release(run_id, reason="never_reset", only_state="allocated"):
                released.append(run_id)
        for run_id in released:
            enqueue_close(self.app, store(), run_id, host)
        reaped += released
        # Released twice the close limit ago and still closing: sent again only if no close
        # job of it is still queued or running (tasks/close_recovery.py).
        stale = cfg.timeouts.close_session * 2
        close_recovery.resend(self.app, host, store().stale_closing_runs(host, stale), stale)
    return reaped


# ---- worker liveness ------------------------------------------------------------------------
BEAT_RETRY_SECONDS = 0.5  # while Redis is away: beat again as soon as it answers


def _heartbeat(node: str, host: str, kind: str, stop: threading.Event) -> None:
    """Beat from a thread of its own on a Redis client of its own with short timeouts: no job
    holds it up, and a Redis that hangs costs a beat, not the next 30 s of them."""
    capacity = hosts.capacity(settings())
    beats = Store.connect(settings(), timeout=hosts.WATCH_TIMEOUT, wait_out=False)
    while not stop.is_set():
        try:
            beats.node_heartbeat(node)
            beats.host_beat(host, node, kind, {**capacity, **disk_check.host_facts(settings())})
            wait = hosts.HEARTBEAT_SECONDS
        except Exception as exc:  # Redis away: the watches judge nothing meanwhile (poolcore/liveness.py)
            log.warning("heartbeat failed: %s", exc)
            wait = BEAT_RETRY_SECONDS
        stop.wait(wait)


_stop_heartbeat = threading.Event()
_beating: dict = {}  # node and kind of this process's heartbeat


def _worker_kind(worker, host: str) -> str:
    """The queue kind this worker consumes (every worker of tasks/worker.py consumes one)."""
    kinds = consumed_kinds(worker.app, host)
    return min(kinds) if kinds else "other"


@worker_ready.connect
def _on_worker_ready(sender=None, **_):
    host = settings().host_id
    _beating.update(node=sender.hostname, kind=_worker_kind(sender, host))
    threading.Thread(
        target=_heartbeat,
        args=(_beating["node"], host, _beating["kind"], _stop_heartbeat),
        daemon=True,
        name="termpool-heartbeat",
    ).start()
    sender.app.send_task("pool.reconcile", kwargs={"host": host, "at_start": True})
    threading.Thread(
        target=disk_usage.learn, args=(_stop_heartbeat,), daemon=True, name="termpool-docker-facts"
    ).start()
    # Asks Docker (and criu) like disk_usage.learn: off the main thread, so a slow dockerd does
    # not hold back the worker's first job.
    threading.Thread(target=_learn_engine_facts, args=(host,), daemon=True, name="termpool-engine-facts").start()


def _learn_engine_facts(host: str) -> None:
    """What /status shows of the host's engine: whether forks carry processes, and whether
    its containers outlive a restart of the engine (dockerd's live-restore)."""
    try:
        store().set_fork_processes(host, *forking.process_carry(settings().fork_processes))
        _note_live_restore(host)
    except Exception:  # Docker or Redis away: /status shows nothing for it until the next start
        log.warning("could not learn the Docker engine's facts", exc_info=True)


def _note_live_restore(host: str) -> None:
    """Whether the host's containers outlive a restart of its engine, for /status."""
    store().set_live_restore(host, docker_client().info().get("LiveRestoreEnabled") is True)


@worker_shutdown.connect
def _on_worker_shutdown(**_):
    """A clean stop: this queue kind of the host is down at once, not HOST_SILENCE_SECONDS later."""
    _stop_heartbeat.set()
    if _beating:
        try:
            store().host_node_stopped(settings().host_id, _beating["node"], _beating["kind"])
        except Exception:  # Redis away: the silence limit tells the same a little later
            log.warning("could not deregister %s", _beating["node"], exc_info=True)
