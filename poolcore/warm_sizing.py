"""How many started spares the warm pool keeps for one task on one host (pure: no Redis, no Docker).

The pool covers the resets that can arrive before a refill catches up: the most resets seen
within any one refill time (REFILL_HEADROOM x the task's measured spare start time) during the
demand window, at least 1 while the window saw any reset and 0 once it saw none. That need is
then capped by the per-task maximum (WARM_POOL_SIZE), by the host's run slots that neither live
runs nor other tasks' spares take, and by what is left of the host's memory budget for spares
(WARM_POOL_MEMORY) at the task's measured idle footprint per spare.
"""

from __future__ import annotations

from dataclasses import dataclass

REFILL_HEADROOM = 2.0  # a refill under load takes up to twice the measured start time
DEFAULT_START_SECONDS = 1.0  # a task's spare start time before one was measured
DEFAULT_IDLE_BYTES = 64 << 20  # a spare's idle memory before one was measured


@dataclass(frozen=True)
class Limits:
    max_size: int  # WARM_POOL_SIZE: spares per task and host at most
    free_slots: int  # the host's run slots not held by live runs nor other tasks' spares
    memory_left: int  # bytes of WARM_POOL_MEMORY not used by other tasks' spares
    idle_bytes: int  # memory one idle spare of this task uses


def peak_within(times: list[float], span: float) -> int:
    """The most of `times` that fall within any interval `span` seconds long."""
    times = sorted(times)
    best, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] > span:
            first += 1
        best = max(best, last - first + 1)
    return best


def demand(resets: list[float], now: float, window: float, start_seconds: float) -> int:
    """Spares wanted for the resets of the last `window` seconds (see the module docstring)."""
    recent = [at for at in resets if now - window < at <= now]
    if not recent:
        return 0
    return max(1, peak_within(recent, REFILL_HEADROOM * max(start_seconds, 0.0)))


def capped(wanted: int, limits: Limits) -> int:
    by_memory = max(limits.memory_left, 0) // max(limits.idle_bytes, 1)
    return max(0, min(wanted, limits.max_size, limits.free_slots, by_memory))


def target(resets: list[float], now: float, window: float, start_seconds: float, limits: Limits) -> int:
    """The pool size to aim for now."""
    return capped(demand(resets, now, window, start_seconds), limits)


def rolling(previous: float | None, sample: float, weight: float = 0.3) -> float:
    """An exponentially weighted mean: recent measurements count most, one outlier little."""
    return sample if previous is None else previous + weight * (sample - previous)
