"""The warm pool: started, prepared spares per one-service task and host, sized from demand.

A reset takes one with LPOP, so no container ever serves two runs. Every reset of a pooled
task (served or missed) is noted as demand and asks for a refill; the pool aims at the size
poolcore/warm_sizing.py gives (demand in the last WARM_DEMAND_WINDOW seconds, within
WARM_POOL_SIZE, the host's free run slots and WARM_POOL_MEMORY). Spares start as separate jobs
on the host's lifecycle queue, a few at a time per task, each starting the next while the pool
is short. Beat's periodic pass (pool.size_warm, on each host's lifecycle queue) removes spares
beyond the target and any pooled longer than WARM_IDLE_TTL, and measures a spare's idle memory;
a lifecycle worker that stops cleanly removes its host's spares.

Pooled containers carry their warm id as run label (labels cannot change later); their warmid
key (poolcore/state/warm.py) keeps them safe from the reconcile sweep while they are wanted.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown

from environments import artifacts, lifecycle
from environments.docker_client import memory_in_use
from environments.session_helper import prepare_container
from environments.tools.server_socket import server_answers
from poolcore import failures, warm_sizing
from poolcore.config import settings
from poolcore.queues import consumed_kinds
from poolcore.state import UNAVAILABLE
from poolcore.task_spec import one_per_host_reasons
from poolcore.uploaded_tasks import docker_task_name
from tasks import image_budget
from tasks.runtime import remove_env, store
from tasks.task_folders import task_dir as find_task_dir

log = logging.getLogger(__name__)

SIZE_SECONDS = 10.0  # beat's period for pool.size_warm: how soon surplus and idle spares go


def claim(run: dict, host: str, run_path) -> lifecycle.RunEnv | None:
    """A pre-started container of this task, handed to this run alone (LPOP), if one is alive.
    Only one-service tasks ever have spares (see demanded), so a reset may try this first and
    ask whether the task is one it pools only when none is there."""
    while True:
        entry = store().warm_claim(host, run["task_meta"]["task_path"], run["run_id"])
        if entry is None:
            return None
        if _alive(entry):
            return lifecycle.RunEnv(
                "direct",
                entry["project"],
                entry["client"],
                str(run_path(run, mounts_from=Path(entry["run_dir"]))),
                warm_id=entry["warm_id"],
                ctl_dir=entry.get("ctl_dir", ""),
                user=entry.get("user", ""),
                workdir=entry.get("workdir", ""),
            )
        _remove_spare(entry)  # died while pooled


def _alive(entry: dict) -> bool:
    """The spare still runs: its tool server takes a connection (no Docker call on the reset's
    path), else Docker says so (a spare whose server alone stopped is still good)."""
    socket_path = lifecycle.ctl_socket(entry)
    if socket_path and server_answers(socket_path):
        return True
    return lifecycle.client_if_running(entry["client"]) is not None


def demanded(app, run: dict, host: str, served: bool) -> None:
    """A reset of a task the pool serves (one-service): its demand, and a refill at once (on a
    miss the spares start beside the run's own cold start)."""
    meta = run["task_meta"]
    store().warm_note_reset(
        host, meta["task_path"], run["run_id"], docker_task_name(meta), served, settings().warm_demand_window
    )
    app.send_task("pool.refill_warm", kwargs={"host": host, "task_path": meta["task_path"]})


NOT_POOLED: set[str] = set()  # tasks this process logged as never pooled (one run per host)


def target_size(host: str, task_path: str) -> int:
    """The size the task's pool on this host should have now (poolcore/warm_sizing.py); 0 for a
    task that allows one live run per host: a spare would hold what its compose file pins (a
    subnet, an address, a host port) and the run placed there would fail to start."""
    cfg = settings()
    reasons = _one_per_host(cfg, task_path)
    if reasons:
        if task_path not in NOT_POOLED:
            NOT_POOLED.add(task_path)
            log.info("no warm spares of %s: it allows one live run per host (%s)", task_path, "; ".join(reasons))
        return 0
    facts = store().warm_facts(host, task_path)
    others = {path: len(entries) for path, entries in store().warm_pools(host).items() if path != task_path and entries}
    limits = warm_sizing.Limits(
        max_size=cfg.warm_pool_size,
        free_slots=cfg.max_tasks * cfg.max_runs_per_task - len(store().live_runs(host)) - sum(others.values()),
        memory_left=cfg.warm_pool_memory - sum(n * _idle_bytes(store().warm_facts(host, p)) for p, n in others.items()),
        idle_bytes=_idle_bytes(facts),
    )
    start_s = facts.get("start_s") or warm_sizing.DEFAULT_START_SECONDS
    resets = store().warm_resets(host, task_path, cfg.warm_demand_window)
    return warm_sizing.target(resets, time.time(), cfg.warm_demand_window, start_s, limits)


def _one_per_host(cfg, task_path: str) -> tuple[str, ...]:
    try:
        return one_per_host_reasons(find_task_dir(task_path, cfg))
    except (ValueError, OSError, failures.Failure):  # no such task folder: its start says so
        return ()


def _idle_bytes(facts: dict) -> int:
    return int(facts.get("idle_bytes") or warm_sizing.DEFAULT_IDLE_BYTES)


def _starts_at_once() -> int:
    """Spares of one task starting at once: at most a quarter of the lifecycle threads, so a
    run's own start seldom waits behind the pool for a thread."""
    return max(1, settings().concurrency["lifecycle"] // 4)


_stopping = threading.Event()  # this lifecycle worker is stopping: no spare is pooled any more


@shared_task(name="pool.refill_warm", bind=True)
def refill_warm(self, *, host, task_path):
    """Start the spares the task's pool lacks (each as its own pool.start_warm job)."""
    return _refill(self.app, host, task_path)


def _refill(app, host: str, task_path: str) -> int:
    if _stopping.is_set():
        return 0
    cfg = settings()
    wanted = target_size(host, task_path)
    ids = store().warm_reserve(host, task_path, wanted, _starts_at_once(), cfg.timeouts.reset_session + 60)
    task_name = store().warm_facts(host, task_path).get("task_name", "")
    for warm_id in ids:
        app.send_task(
            "pool.start_warm", kwargs={"host": host, "task_path": task_path, "task_name": task_name, "warm_id": warm_id}
        )
    return len(ids)


@shared_task(name="pool.start_warm", bind=True)
def start_warm(self, *, host, task_path, task_name, warm_id):
    """Start one spare under its reserved warm id, pool it, and go on refilling."""
    if _stopping.is_set():
        with contextlib.suppress(UNAVAILABLE):
            store().warm_unreserve(host, task_path, warm_id)
        return 0
    cfg = settings()
    began, cpu = time.monotonic(), time.thread_time()
    pseudo_run = {"run_id": warm_id, "task_key": task_name, "task_meta": {"task_name": task_name}}
    run_dir = _warm_dir(cfg, warm_id)
    try:
        task_dir = find_task_dir(task_path, cfg)
        env, container = lifecycle.start(pseudo_run, task_dir, run_dir, cfg, cfg.timeouts.reset_session)
        try:
            if not env.booted:  # else its tool server started with it
                prepare_container(container, serve=bool(env.ctl_dir))
            store().warm_push(host, task_path, _entry(warm_id, task_path, env))
            if _stopping.is_set():  # the drain on stop may have run before this push: this one too
                drain(host)
                return 0
        except BaseException:  # Redis away too: no spare the pool does not know of
            remove_env(warm_id, env.to_dict())
            raise
    except BaseException:
        with contextlib.suppress(UNAVAILABLE):  # else its claim lapses by itself
            store().warm_unreserve(host, task_path, warm_id)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    seconds = time.monotonic() - began
    previous = store().warm_facts(host, task_path).get("start_s")
    store().warm_set_facts(host, task_path, start_s=round(warm_sizing.rolling(previous, seconds), 3))
    store().warm_count_event(host, started=1, start_s=seconds, cpu_s=time.thread_time() - cpu)
    image_budget.note_started(host, task_path, env.client)
    return _refill(self.app, host, task_path) + 1


def _entry(warm_id: str, task_path: str, env: lifecycle.RunEnv) -> dict:
    """What the pool keeps of a spare (and claim turns into the run's RunEnv)."""
    return {
        "warm_id": warm_id,
        "task_path": task_path,
        "client": env.client,
        "project": env.project,
        "run_dir": env.run_dir,
        "ctl_dir": env.ctl_dir,
        "user": env.user,
        "workdir": env.workdir,
    }


@shared_task(name="pool.size_warm_hosts", bind=True)
def size_warm_hosts(self):
    """Beat's fan-out: each live host sizes its own pools; a message expires after one period,
    so a host whose lifecycle queue is stalled gets one pending pass, not a backlog."""
    hosts = store().live_hosts()
    for host in hosts:
        self.app.send_task("pool.size_warm", kwargs={"host": host}, expires=SIZE_SECONDS)
    return hosts


@shared_task(name="pool.size_warm", bind=True)
def size_warm(self, *, host):
    """Beat's periodic pass on one host: trim every pool to its target and the idle TTL,
    measure a spare's idle memory per task, refill pools below target, forget idle tasks."""
    cfg = settings()
    began, cpu = time.monotonic(), time.thread_time()
    trimmed = expired = 0
    sizes = {}
    for task_path in sorted(store().warm_tasks(host)):
        keep = target_size(host, task_path)
        cutoff = time.time() - cfg.warm_idle_ttl
        for entry in store().warm_trim(host, task_path, keep, cutoff):
            _remove_spare(entry)
            if entry.get("pushed_at", 0) < cutoff:
                expired += 1
            else:
                trimmed += 1
        if keep > store().warm_count(host, task_path) + store().warm_starting(host, task_path):
            _refill(self.app, host, task_path)
        elif keep == 0:
            store().warm_forget_task(host, task_path, cfg.warm_demand_window)
        sizes[task_path] = keep
    _measure_idle_memory(host)
    store().warm_count_event(
        host, trimmed=trimmed, expired=expired, upkeep_s=time.monotonic() - began, cpu_s=time.thread_time() - cpu
    )
    return sizes


def _measure_idle_memory(host: str) -> None:
    """One spare per task (the longest pooled: the most settled) is measured; in parallel, as a
    one-shot stats call waits for the daemon's next sample (up to a second)."""
    oldest = {path: entries[0] for path, entries in store().warm_pools(host).items() if entries}
    if not oldest:
        return
    with ThreadPoolExecutor(min(8, len(oldest))) as pool:
        measured = dict(zip(oldest, pool.map(lambda e: memory_in_use(e["client"]), oldest.values())))
    for task_path, used in measured.items():
        if used is not None:
            previous = store().warm_facts(host, task_path).get("idle_bytes")
            store().warm_set_facts(host, task_path, idle_bytes=int(warm_sizing.rolling(previous, used)))


def discard(host: str, task_path: str) -> int:
    """Remove every pooled spare of one task: made from an image of the task as it was."""
    entries = store().warm_trim(host, task_path, 0, float("inf"))
    for entry in entries:
        _remove_spare(entry)
    return len(entries)


def drain(host: str) -> int:
    """Remove every spare of the host (a clean stop: nothing is left for a sweep to find)."""
    removed = _drop_starts(host)
    for task_path in store().warm_tasks(host):
        removed += discard(host, task_path)
    if removed:
        store().warm_count_event(host, drained=removed)
    return removed


def _drop_starts(host: str) -> int:
    """Remove what spare starts of the host left: a lifecycle worker that died mid-start leaves
    a container its claim would keep from the sweep until the claim lapses (minutes)."""
    cfg = settings()
    dropped = 0
    for task_path in store().warm_tasks(host):
        for warm_id in store().warm_take_starting(host, task_path):
            dropped += lifecycle.remove_run_resources(warm_id)
            lifecycle.remove_ctl_dir(str(cfg.socket_dir / warm_id))
            shutil.rmtree(_warm_dir(cfg, warm_id), ignore_errors=True)
    return dropped


def _consumes_lifecycle(worker) -> bool:
    host = settings().host_id
    return "lifecycle" in consumed_kinds(worker.app, host)


@worker_ready.connect
def _drop_starts_on_start(sender=None, **_):
    """A lifecycle worker starts: no spare is being started on its host (one lifecycle worker
    per host), so any start on record is one its predecessor died in."""
    if sender is None or not _consumes_lifecycle(sender):
        return
    try:
        _drop_starts(settings().host_id)
    except Exception:  # Redis or Docker away: the claims lapse and the sweep removes them later
        log.warning("could not remove spares left half-started", exc_info=True)


@worker_shutdown.connect
def _drain_on_stop(sender=None, **_):
    """The lifecycle worker (which starts the spares) stops cleanly: its host's spares go.
    Celery may send this while jobs still run (a stop from its signal handler, with a thread
    pool): a spare start still under way sees _stopping and removes what it made itself."""
    if sender is None or not _consumes_lifecycle(sender):
        return
    _stopping.set()
    try:
        removed = drain(settings().host_id)
    except Exception:  # Redis or Docker away: the periodic trim or the reconcile sweep removes them later
        log.warning("could not remove the warm pool's spares", exc_info=True)
        return
    if removed:
        log.info("removed %d warm spares on shutdown", removed)


def _remove_spare(entry: dict) -> None:
    """A spare taken out of the pool: its container, socket folder, warm folder and claim."""
    remove_env(entry["warm_id"], {"ctl_dir": entry.get("ctl_dir", "")})
    store().warm_forget(entry["warm_id"])
    if entry.get("run_dir"):
        shutil.rmtree(entry["run_dir"], ignore_errors=True)


def _warm_dir(cfg, warm_id: str) -> Path:
    return artifacts.run_dir(str(cfg.output_root / ".warm"), "pool", "0", warm_id)
