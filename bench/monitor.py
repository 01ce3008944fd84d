"""A sampling thread: RSS of termpool's own processes by kind, and live runs from /status.

Every `interval` seconds it sums the resident memory of each stack process together with all
its descendants (gunicorn's master and workers are the facade; each Celery worker kind with
any pool children; redis-server), and reads /status for the number of live runs. Peaks are
kept per phase (the label the benchmark sets) and for the whole run.
"""

from __future__ import annotations

import threading
import time

import psutil

from termpool.client import Pool

MB = 1024 * 1024
FACADE = "facade"


def kind_of(proc_name: str) -> str:
    return FACADE if proc_name == "web" else proc_name


class Monitor:
    def __init__(self, procs: dict, url: str, interval: float = 0.5):
        self.procs = procs  # name -> Popen, as devstack.Stack keeps them
        self.interval = interval
        self.phase = "setup"
        self.samples = 0
        self.peaks: dict[str, dict] = {}  # phase -> {"total_mb", "by_kind_mb": {...}, "live_runs"}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self._client = Pool(url, timeout=5, retries=0)  # a sample, not a must: never waits for one
        self._cache: dict[int, psutil.Process] = {}

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._client.close()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase

    # ---- sampling -------------------------------------------------------------------------
    def _process(self, pid: int) -> psutil.Process | None:
        proc = self._cache.get(pid)
        if proc is None:
            try:
                proc = self._cache[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return proc

    def rss_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, popen in list(self.procs.items()):
            root = self._process(popen.pid)
            if root is None:
                continue
            total = 0
            try:
                members = [root, *root.children(recursive=True)]
            except psutil.Error:
                members = [root]
            for proc in members:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            kind = kind_of(name)
            out[kind] = out.get(kind, 0.0) + total / MB
        return out

    def live_runs(self) -> int | None:
        try:
            return int(self._client.status()["total_active_runs"])
        except Exception:
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            by_kind = self.rss_by_kind()
            live = self.live_runs()
            with self._lock:
                self.samples += 1
                for phase in (self.phase, "all"):
                    peak = self.peaks.setdefault(phase, {"total_mb": 0.0, "by_kind_mb": {}, "live_runs": 0})
                    peak["total_mb"] = max(peak["total_mb"], sum(by_kind.values()))
                    for kind, mb in by_kind.items():
                        peak["by_kind_mb"][kind] = max(peak["by_kind_mb"].get(kind, 0.0), mb)
                    if live is not None:
                        peak["live_runs"] = max(peak["live_runs"], live)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def peak(self, phase: str) -> dict:
        with self._lock:
            peak = self.peaks.get(phase) or {"total_mb": 0.0, "by_kind_mb": {}, "live_runs": 0}
            return {
                "total_mb": round(peak["total_mb"], 1),
                "by_kind_mb": {k: round(v, 1) for k, v in sorted(peak["by_kind_mb"].items())},
                "live_runs": peak["live_runs"],
            }

    def peak_over(self, phases: list[str]) -> dict:
        """The highest figures over several phases (e.g. every phase of one concurrency level)."""
        total, by_kind, live = 0.0, {}, 0
        for phase in phases:
            peak = self.peak(phase)
            total = max(total, peak["total_mb"])
            live = max(live, peak["live_runs"])
            for kind, mb in peak["by_kind_mb"].items():
                by_kind[kind] = max(by_kind.get(kind, 0.0), mb)
        return {"total_mb": round(total, 1), "by_kind_mb": dict(sorted(by_kind.items())), "live_runs": live}
