"""Latency samples and their summaries: percentiles per repeat, medians across repeats."""

from __future__ import annotations

import math
import statistics
import threading
from collections import defaultdict

STAT_KEYS = ("p50", "p95", "max", "mean")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: list[float]) -> dict:
    """p50/p95/max/mean (milliseconds, rounded) and the sample count of one repeat."""
    if not values:
        return {"n": 0, **{k: None for k in STAT_KEYS}}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), 2),
        "p95": round(percentile(values, 95), 2),
        "max": round(max(values), 2),
        "mean": round(statistics.fmean(values), 2),
    }


def median_of(summaries: list[dict]) -> dict:
    """Median of each statistic over repeats (the figure reported), plus the repeats' own."""
    out: dict = {"n": sum(s["n"] for s in summaries)}
    for key in STAT_KEYS:
        values = [s[key] for s in summaries if s.get(key) is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    out["repeats"] = summaries
    return out


def median_value(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


class Recorder:
    """Thread-safe collection of one phase's samples (ms per operation) and errors."""

    MAX_MESSAGES = 5

    def __init__(self):
        self._lock = threading.Lock()
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.error_count = 0
        self.error_messages: list[str] = []
        self.episodes_ok = 0
        self.episodes_failed = 0
        self.run_ids: set[str] = set()  # termpool runs (leases) this phase created

    def run(self, run_id: str) -> None:
        with self._lock:
            self.run_ids.add(run_id)

    def add(self, op: str, ms: float) -> None:
        with self._lock:
            self.samples[op].append(ms)

    def error(self, message: str) -> None:
        with self._lock:
            self.error_count += 1
            if len(self.error_messages) < self.MAX_MESSAGES:
                self.error_messages.append(message[:500])

    def episode_done(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.episodes_ok += 1
            else:
                self.episodes_failed += 1
