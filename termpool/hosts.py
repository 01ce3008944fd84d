"""Many worker hosts behind one Redis: which are serving, where a run goes, what a lost one means.

A worker process beats every few seconds with its host, its queue kind and its host's capacity
(tasks/maintenance.py). From those beats:

* a host serves when every queue kind of it beat within HOST_SILENCE_SECONDS and it is not
  draining; allocate places a run only on a serving host (state.Store.place);
* a call on a run whose host has no worker that beat within the limit fails at once with
  HOST_LOST (the host's live runs are marked lost, its capacity freed); when only the call's
  queue kind is silent, with WORKERS_DOWN;
* a host with no beat at all on record (never seen, or a Redis that lost its data a moment
  ago) is not judged, nor is any host while Redis has been up for less than the limit (it
  restarted: the workers could not beat meanwhile): calls wait for their time limits as before.

Used by the facade (app/engine.py), the reaper and the CLI; imports nothing Docker-side.
"""

from __future__ import annotations

import time

from termpool.config import QUEUE_KINDS, Settings
from termpool.state import HOST_FORGET_SECONDS, Placement, Store

HEARTBEAT_SECONDS = 3.0  # how often every worker process beats; well under HOST_SILENCE_SECONDS
# Allocate reads Redis's uptime at most this often (INFO is no cheap call); a restart is
# noticed that much later, while every call fails on the restart itself anyway.
UPTIME_READ_SECONDS = 1.0
# A call's check of its host reuses a read of the host's beats this young (RecentBeats).
BEATS_READ_SECONDS = 1.0

# Image affinity: a host that already has the task's images wins over the least loaded one
# when its load (live runs over capacity) is at most this much higher; one cold start (a
# build) costs far more than running a few more runs on a host.
AFFINITY_SLACK = 0.1

# Queue kinds a job of each kind (job records' `kind`) needs. Not closes: a lost host's
# teardowns wait in its queue and run when it is back (the client's close answers at once).
JOB_QUEUE_KINDS = {
    "start": ("build", "lifecycle"),
    "tool_call": ("exec",),
    "evaluation": ("eval",),
}


def placement(cfg: Settings, store: Store, now: float | None = None) -> Placement:
    """How allocate weighs hosts now. While Redis is younger than the silence limit (it
    restarted: no worker could beat meanwhile) a host's last beats count however old, as
    `unavailable` judges no host then: allocations go on through a Redis restart."""
    settled = store.redis_uptime(max_age=UPTIME_READ_SECONDS) >= cfg.host_silence
    return Placement(
        cutoff=(now or time.time()) - cfg.host_silence if settled else 0.0,
        kinds=len(QUEUE_KINDS),
        default_tasks=cfg.max_tasks,
        default_runs=cfg.max_runs_per_task,
        slack=AFFINITY_SLACK,
        fallback=cfg.host_id,
    )


def capacity(cfg: Settings) -> dict:
    """What a host publishes with its heartbeat: its own limits, not the facade's."""
    return {"max_tasks": cfg.max_tasks, "max_runs_per_task": cfg.max_runs_per_task}


def judge(nodes: dict, now: float, silence: float) -> tuple[set, bool]:
    """The queue kinds of a host heard from within `silence`, and whether the host is lost:
    none heard from, or some kind silent while no worker of it beat for two heartbeats (a
    whole host that stopped goes silent kind by kind, up to a heartbeat apart)."""
    alive = {kind for kind, at in nodes.values() if at >= now - silence}
    recent = any(at >= now - 2 * HEARTBEAT_SECONDS for _, at in nodes.values())
    return alive, not alive or (len(alive) < len(QUEUE_KINDS) and not recent)


def unavailable(store: Store, host: str, kinds: tuple, silence: float) -> str:
    """'' when the host's workers of these queue kinds beat within `silence` seconds, else the
    failure code: HOST_LOST when none of its workers did, WORKERS_DOWN when some kind is silent."""
    nodes = store.host_nodes(host)
    if not nodes:
        return ""  # nothing on record: not judged (see the module docstring)
    alive, lost = judge(nodes, time.time(), silence)
    missing = set(kinds) - alive
    code = "HOST_LOST" if lost else "WORKERS_DOWN" if missing else ""
    if code and store.redis_uptime() < silence:
        return ""  # Redis itself was away (a restart): every worker was silent, none is lost
    return code


def message(code: str, host: str, kinds: tuple, silence: float) -> str:
    if code == "HOST_LOST":
        return f"worker host {host} is lost: none of its workers has been heard from for {silence:g} s"
    return f"no live worker of host {host} consumes its {'/'.join(kinds)} queue (silent for {silence:g} s)"


class RecentBeats:
    """Each host's worker beats as last read, reread when older than BEATS_READ_SECONDS: a call
    on a serving host needs no read of its own. Beats only move forward, so an old read can
    only make a host look more silent; whatever it shows that is not serving is read again. (A
    host's clean stop, which zeroes its beats, is seen up to max_age late.)"""

    def __init__(self, store: Store, max_age: float | None = None):
        self.store = store
        self.max_age = BEATS_READ_SECONDS if max_age is None else max_age
        self._seen: dict[str, tuple[float, dict]] = {}  # host -> (read at, monotonic; nodes)

    def serving(self, host: str, kinds: tuple, silence: float) -> bool:
        now = time.monotonic()
        seen = self._seen.get(host)
        if seen is None or now - seen[0] > self.max_age:
            seen = self._seen[host] = (now, self.store.host_nodes(host))
        alive, lost = judge(seen[1], time.time(), silence)
        return not lost and set(kinds) <= alive


def check(store: Store, host: str, kinds: tuple, silence: float, beats: RecentBeats | None = None) -> tuple[str, str]:
    """(code, error) for a call needing these queue kinds of `host`; ('', '') when it may go.
    A lost host's runs are marked lost on the way (idempotent)."""
    if beats is not None and beats.serving(host, kinds, silence):
        return "", ""
    code = unavailable(store, host, kinds, silence)
    if not code:
        return "", ""
    error = message(code, host, kinds, silence)
    if code == "HOST_LOST":
        store.mark_host_lost(host, error)
    return code, error


def sweep(store: Store, silence: float) -> dict[str, list[str]]:
    """The reaper's pass: mark every silent host's runs lost; forget hosts silent for an hour.
    Returns the runs marked lost, by host."""
    now = time.time()
    marked = {}
    if store.redis_uptime() < silence:
        return marked  # Redis restarted: the workers could not beat meanwhile
    for host, last in store.known_hosts().items():
        if last >= now - silence:
            continue
        if last < now - HOST_FORGET_SECONDS and not store.lost_runs(host):
            store.forget_host(host)
            continue
        runs = store.mark_host_lost(host, message("HOST_LOST", host, (), silence))
        if runs:
            marked[host] = runs
    return marked


def overview(store: Store, cfg: Settings) -> dict[str, dict]:
    """Per host: state (serving / draining / workers_down / lost), capacity, live runs, images
    cached, last heartbeat and the queue kinds heard from (for /status and `hosts list`)."""
    now = time.time()
    draining = store.draining_hosts()
    known = store.known_hosts()
    out = {}
    for host in sorted(set(known) | draining):
        alive, lost = judge(store.host_nodes(host), now, cfg.host_silence)
        if lost:
            state = "lost"
        elif host in draining:
            state = "draining"
        elif len(alive) < len(QUEUE_KINDS):
            state = "workers_down"
        else:
            state = "serving"
        info = store.host_info(host)
        out[host] = {
            "state": state,
            "draining": host in draining,
            "capacity": {
                "max_tasks": int(info.get("max_tasks", cfg.max_tasks)),
                "max_runs_per_task": int(info.get("max_runs_per_task", cfg.max_runs_per_task)),
            },
            **store.host_load(host),
            "last_heartbeat": known.get(host),
            "live_queue_kinds": sorted(alive),
        }
    return out
