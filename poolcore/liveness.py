"""Which workers are alive, as one process has seen them: the failure detector.

Every worker process writes its beat (its queue kind and wall-clock time) into its host's
nodes hash every few seconds (tasks/maintenance.py). A judging process (each facade process,
and the worker running the reaper) keeps a `Watch`: a daemon thread that reads every host's
beats once a second on a Redis client of its own, and judges only by what it saw itself:

* a worker is *alive* once this watch saw its beat advance. Records left by a previous
  incarnation of a host (same POOL_HOST_ID, processes since killed) never advance, so they are
  never judged: a host that restarts is *starting*, not lost, and its jobs wait in their queues;
* a worker seen alive is *silent* once its beat has not advanced for `silence` seconds during
  which this watch itself reached Redis without a break. A clean stop (beat 0) is no exception:
  a worker restarted by a deploy or its supervisor beats again well within the limit.
  A Redis outage, restart or partition is nobody's death: the time Redis could not be reached
  does not count, and once it answers again every worker has `silence` seconds to beat;
* a queue kind of a host is *down* when each of its workers that was seen alive is silent and
  no new one of it has appeared within the limit (a restarted worker has a new name); a
  host is *lost* when every worker of it seen alive is silent, or some kind is down while none
  of its workers beat within `recent` seconds (a whole host that stopped crosses the limit
  kind by kind, up to a heartbeat apart).

So WORKERS_DOWN and HOST_LOST only ever name workers that served while this process watched
and then fell silent. A slow detector fails nothing that would have succeeded; a hasty one does.
Pure logic (`observe`, `judge`) apart from the thread, for the unit tests.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WATCH_SECONDS = 1.0  # how often a watch reads the beats (and so how late it can see one)


@dataclass
class Seen:
    """One worker (node) as this watch saw it."""

    kind: str
    beat: float  # the last beat read (0: stopped cleanly)
    changed_at: float  # monotonic: when this watch first read that beat
    alive: bool = False  # its beat advanced while watched
    appeared: bool = False  # new since this watch first read its host: a worker (re)starting


@dataclass
class HostJudgement:
    serving: set = field(default_factory=set)  # kinds with a worker alive and not silent
    down: set = field(default_factory=set)  # kinds seen alive, every such worker silent now
    lost: bool = False  # workers were seen alive, and every one of them is silent now

    @property
    def starting(self) -> bool:
        """Nothing of it judged yet: no worker seen alive by this watch."""
        return not self.serving and not self.down

    def state(self, kinds: tuple) -> str:
        if self.lost:
            return "lost"
        if set(kinds) <= self.serving:
            return "serving"
        return "workers_down" if self.down else "starting"


def observe(known: dict[str, Seen] | None, nodes: dict[str, tuple[str, float]], now: float) -> dict[str, Seen]:
    """A host's nodes as read now (node -> (kind, beat)), folded into what was seen before
    (None: the host's first read, whose nodes may be a previous incarnation's). A node gone
    from the hash (Redis lost its data, or the host was forgotten) is forgotten too."""
    seen = {}
    for node, (kind, beat) in nodes.items():
        before = (known or {}).get(node)
        if before is None:
            seen[node] = Seen(kind, beat, now, appeared=known is not None)
        elif beat != before.beat:
            seen[node] = Seen(kind, beat, now, alive=before.alive or beat != 0, appeared=before.appeared)
        else:
            seen[node] = before
    return seen


def silent(node: Seen, now: float, silence: float, contact_since: float) -> bool:
    """A node seen alive whose beat stood still for `silence` seconds of unbroken contact."""
    return node.alive and now - max(node.changed_at, contact_since) > silence


def judge(seen: dict[str, Seen], now: float, silence: float, contact_since: float, recent: float) -> HostJudgement:
    out = HostJudgement()
    watched = [node for node in seen.values() if node.alive]
    for node in watched:
        if silent(node, now, silence, contact_since):
            out.down.add(node.kind)
        else:
            out.serving.add(node.kind)
    # A worker that appeared while watched and has beaten once is its kind's replacement
    # starting (a restart gives a new node name): the kind waits for it, within the limit.
    starting = {n.kind for n in seen.values() if n.appeared and not n.alive and now - n.changed_at <= silence}
    out.down -= out.serving | starting
    beating = any(now - node.changed_at < recent for node in watched)
    out.lost = bool(watched) and not starting and (not out.serving or (bool(out.down) and not beating))
    return out


@dataclass
class Snapshot:
    hosts: dict[str, float]  # every host in the hosts list, with its last beat
    draining: set
    nodes: dict[str, dict[str, tuple[str, float]]]  # host -> node -> (kind, beat)


class Watch:
    """One process's view of every host's workers (module docstring). `read(also)` returns a
    Snapshot from Redis (Store.beats_snapshot on a client with short timeouts) of the hosts
    list's hosts and of `also`, the hosts this watch already follows (a host that stopped
    cleanly leaves the list, but its workers are still judged). Made in the process that uses
    it, after any fork (gunicorn loads the app in each worker process)."""

    def __init__(self, read, silence: float, recent: float, period: float = WATCH_SECONDS):
        self._read = read
        self.silence = silence
        self.recent = recent
        self.period = period
        self._lock = threading.Lock()  # the state below, read by callers
        self._polling = threading.Lock()  # one read at a time
        self._seen: dict[str, dict[str, Seen]] = {}
        self._snapshot = Snapshot({}, set(), {})
        self._contact_since: float | None = None  # monotonic; None while Redis is unreachable
        self._stop = threading.Event()

    # ---- the thread ---------------------------------------------------------------------------
    def start(self) -> Watch:
        """Poll from a daemon thread of this process (tests call poll() themselves instead)."""
        threading.Thread(target=self._loop, daemon=True, name="termpool-watch").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period)

    def poll(self) -> None:
        """One read of every host's beats: the thread's step, and a caller's about to refuse
        a call (hosts.check). One at a time, so reads are folded in in the order they were made."""
        with self._polling:
            try:
                snap = self._read(set(self._seen))
            except Exception as exc:  # Redis away: nothing is judged until contact is back
                if self._contact_since is not None:
                    log.warning("liveness watch lost contact with Redis: %s", exc)
                self._contact_since = None
                return
            now = time.monotonic()
            with self._lock:
                if self._contact_since is None:
                    self._contact_since = now
                self._seen = {host: observe(self._seen.get(host), nodes, now) for host, nodes in snap.nodes.items()}
                self._snapshot = snap

    # ---- what callers ask ---------------------------------------------------------------------
    def judgement(self, host: str) -> HostJudgement:
        now = time.monotonic()
        with self._lock:
            if self._contact_since is None:
                return HostJudgement()  # no contact now: judge nothing
            return judge(self._seen.get(host, {}), now, self.silence, self._contact_since, self.recent)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot
