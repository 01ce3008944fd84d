"""Many worker hosts behind one Redis: which are serving, where a run goes, what a lost one means.

A worker process beats every few seconds with its host, its queue kind and its host's capacity
(tasks/maintenance.py). Each judging process reads those beats through its own watch
(poolcore/liveness.py: only workers it saw alive, only time it could reach Redis). From it:

* allocate prefers the hosts that serve every queue kind and are not draining; when there is
  none, any known host not judged lost or draining (one starting, or with a kind down: its
  other kinds serve, jobs for the missing kind wait in their queue or fail WORKERS_DOWN); with
  no host known at all (a fresh Redis), the facade's own host id (state.Store.place). Never a
  host another process already judged lost, until it beats again (watches read a beat up to a
  second apart: one that read the host's last beat later still counts it alive meanwhile);
* a call on a run whose host is judged lost fails at once with HOST_LOST (the host's live runs
  are marked lost, its capacity freed); when a queue kind the call needs is down, with
  WORKERS_DOWN. A host or kind that is starting is not judged: calls wait in its queue for
  their usual time limits, as any Celery job waits for a worker;
* /readyz answers 200 once some host serves every queue kind (`readiness`).

Used by the facade (app/engine.py), the reaper and the CLI; imports nothing Docker-side.
"""

from __future__ import annotations

import functools
import json
import time

from poolcore import liveness
from poolcore.config import QUEUE_KINDS, Settings, settings
from poolcore.state import HOST_FORGET_SECONDS, Placement, Store

HEARTBEAT_SECONDS = 3.0  # how often every worker process beats; well under HOST_SILENCE_SECONDS
WATCH_TIMEOUT = 2.0  # a watch's reads give up this soon: a hung Redis is an outage, not a pause

# Image affinity: a host that already has the task's images wins over the least loaded one
# when its load (live runs over capacity) is at most this much higher; one cold start (a
# build) costs far more than running a few more runs on a host.
AFFINITY_SLACK = 0.1

# Queue kinds a job of each kind (job records' `kind`) needs. Not closes: a lost host's
# teardowns wait in its queue and run when it is back (the client's close answers at once).
JOB_QUEUE_KINDS = {
    "start": ("build", "lifecycle"),
    "tool_call": ("exec",),
    "command": ("exec",),
    "evaluation": ("eval",),
    "fork": ("lifecycle",),
    "put_archive": ("exec",),
    "get_archive": ("exec",),
}


def make_watch(cfg: Settings, reader: Store | None = None) -> liveness.Watch:
    """A watch of every host (not started), reading through `reader`, by default a Redis client
    of its own with short timeouts."""
    reader = reader or Store.connect(cfg, timeout=WATCH_TIMEOUT, wait_out=False)

    def read(also: set) -> liveness.Snapshot:
        return liveness.Snapshot(*reader.beats_snapshot(also))

    return liveness.Watch(read, silence=cfg.host_silence, recent=2 * HEARTBEAT_SECONDS)


@functools.lru_cache(maxsize=1)
def process_watch() -> liveness.Watch:
    """The one watch of a worker process (the reaper's judgement), polling from its first use."""
    return make_watch(settings()).start()


def look(watch: liveness.Watch, seconds: float = HEARTBEAT_SECONDS + 1) -> None:
    """Wait a heartbeat's time: a running watch of a process that just started (the CLI) has
    then seen every live worker's beat advance, and judges like a facade that ran all along."""
    time.sleep(seconds)


def placement(cfg: Settings, watch: liveness.Watch, runs_per_host: int = 0) -> Placement:
    """How allocate weighs hosts now (module docstring); runs_per_host > 0 caps the task key's
    runs on any one host (a task that allows one live run per host: TaskSpec.one_per_host)."""
    snap = watch.snapshot()
    preferred, excluded = [], []
    for host in snap.hosts:
        judged = watch.judgement(host)
        if judged.lost:
            excluded.append(host)
        elif judged.state(QUEUE_KINDS) == "serving":
            preferred.append(host)
    return Placement(
        preferred=preferred,
        excluded=excluded,
        default_tasks=cfg.max_tasks,
        default_runs=cfg.max_runs_per_task,
        slack=AFFINITY_SLACK,
        fallback=cfg.host_id,
        runs_per_host=runs_per_host,
    )


def capacity(cfg: Settings) -> dict:
    """What a host publishes with its heartbeat: its own limits, not the facade's."""
    return {"max_tasks": cfg.max_tasks, "max_runs_per_task": cfg.max_runs_per_task, "networks": cfg.run_subnets.count}


def unavailable(watch: liveness.Watch, host: str, kinds: tuple) -> str:
    """'' when the call may go (the kinds serve, or are not judged yet), else the failure code:
    HOST_LOST when the host is judged lost, WORKERS_DOWN when a kind it needs is down."""
    judged = watch.judgement(host)
    if judged.lost:
        return "HOST_LOST"
    return "WORKERS_DOWN" if judged.down & set(kinds) else ""


def message(code: str, host: str, kinds: tuple, silence: float) -> str:
    if code == "HOST_LOST":
        return f"worker host {host} is lost: none of its workers has been heard from for {silence:g} s"
    return f"no live worker of host {host} consumes its {'/'.join(kinds)} queue (silent for {silence:g} s)"


def check(store: Store, watch: liveness.Watch, host: str, kinds: tuple) -> tuple[str, str]:
    """(code, error) for a call needing these queue kinds of `host`; ('', '') when it may go.
    A lost host's runs are marked lost on the way (idempotent)."""
    if not unavailable(watch, host, kinds):
        return "", ""
    watch.poll()  # read again before refusing: a worker may have beaten since the watch's last read
    beat = last_beat(watch, host)
    code = unavailable(watch, host, kinds)
    if not code:
        return "", ""
    error = message(code, host, kinds, watch.silence)
    if code == "HOST_LOST":
        store.mark_host_lost(host, error, beat)
    return code, error


def last_beat(watch: liveness.Watch, host: str) -> float:
    """The host's last beat in the watch's latest read (0: not listed), for its mark as lost.
    Taken before the judgement it goes with, which is then at least as new: a beat the mark
    does not hold was written after the judgement's read, and lifts the mark (Store.place)."""
    return watch.snapshot().hosts.get(host, 0.0)


def sweep(store: Store, watch: liveness.Watch) -> dict[str, list[str]]:
    """The reaper's pass: mark the runs of every host judged lost as lost; forget hosts silent
    for an hour. Returns the runs marked lost, by host."""
    now = time.time()
    marked = {}
    for host, last in store.known_hosts().items():
        if last < now - HOST_FORGET_SECONDS and not store.lost_runs(host):
            store.forget_host(host)
            continue
        beat = last_beat(watch, host)
        if watch.judgement(host).lost:
            runs = store.mark_host_lost(host, message("HOST_LOST", host, (), watch.silence), beat)
            if runs:
                marked[host] = runs
    return marked


def overview(store: Store, cfg: Settings, watch: liveness.Watch) -> dict[str, dict]:
    """Per host: state (serving / starting / draining / workers_down / lost), capacity, live
    runs, images cached, last heartbeat, the queue kinds serving and its disks (for /status and
    `hosts list`)."""
    snap = watch.snapshot()
    draining = snap.draining
    marks = store.lost_marks()
    out = {}
    for host in sorted(set(snap.hosts) | draining):
        judged = watch.judgement(host)
        state = judged.state(QUEUE_KINDS)
        if host in marks and snap.hosts.get(host, 0.0) <= marks[host]:
            state = "lost"  # another process judged it so, and this one has seen no beat since
        if host in draining and state != "lost":
            state = "draining"
        info = store.host_info(host)
        out[host] = {
            "state": state,
            "draining": host in draining,
            "capacity": {
                "max_tasks": int(info.get("max_tasks", cfg.max_tasks)),
                "max_runs_per_task": int(info.get("max_runs_per_task", cfg.max_runs_per_task)),
            },
            **store.host_load(host),
            "last_heartbeat": snap.hosts.get(host),
            "live_queue_kinds": sorted(judged.serving),
            "disk": disk_view(info),
            "networks": networks_view(store, host, int(info.get("networks", cfg.run_subnets.count))),
            # whether forks carry processes, and why (FORK_PROCESSES, CRIU, dockerd --experimental)
            "fork_processes": {
                "carried": info.get("fork_processes_carried") == "1",
                "reason": info.get("fork_processes") or "not reported yet",
            },
            # the pool's registry as this host's reconcile or last build found it
            "registry": {
                "state": info.get("registry") or "not reported yet",
                "detail": info.get("registry_detail", ""),
                "checked_at": float(info["registry_at"]) if info.get("registry_at") else None,
            },
            # dockerd's live-restore: runs survive a restart of the engine (None: not reported yet)
            "live_restore": info["live_restore"] == "1" if "live_restore" in info else None,
        }
    return out


def networks_view(store: Store, host: str, total: int) -> dict:
    """A host's run networks: blocks of its RUN_SUBNETS held by live runs, reserved (in use
    outside termpool, found at its workers' start) and free."""
    in_use, reserved = store.subnets_in_use(host)
    return {"total": total, "in_use": in_use, "reserved": reserved, "free": max(0, total - in_use - reserved)}


def disk_view(info: dict) -> dict:
    """A host's disk facts from its heartbeat (tasks/disk_check.host_facts): free space per
    root, whether it takes new runs, and whether the storage driver enforces run sizes."""
    return {
        "low": info.get("disk_low") or "",
        "spaces": json.loads(info.get("disk") or "[]"),
        "storage_quota": info.get("storage_quota") or "",
    }


def readiness(watch: liveness.Watch) -> tuple[bool, str]:
    """Ready once some host not draining serves every queue kind; else why not. Read again
    before saying no, as check() does: each facade process has a watch of its own, reading
    once a second, and a probe that another process answered 200 a moment ago must not get
    a 503 here for a beat this watch has not read yet."""
    ready, reason = _readiness(watch)
    if not ready:
        watch.poll()
        ready, reason = _readiness(watch)
    return ready, reason


def _readiness(watch: liveness.Watch) -> tuple[bool, str]:
    snap = watch.snapshot()
    if not snap.hosts:
        return False, "no worker host has sent a heartbeat yet"
    reasons = []
    for host in sorted(snap.hosts):
        judged = watch.judgement(host)
        state = judged.state(QUEUE_KINDS)
        if state == "serving" and host not in snap.draining:
            return True, f"host {host} serves every queue kind"
        waiting = sorted(set(QUEUE_KINDS) - judged.serving)
        reasons.append(
            f"host {host} is {'draining' if host in snap.draining else state}, waiting for {', '.join(waiting) or 'nothing'}"
        )
    return False, "; ".join(reasons)
