"""The warm pool's share of a measurement, and which containers left on the host are its spares.

The pool's work runs in the stack's lifecycle worker (tasks/warm_pool.py), which counts it in
Redis (Store.warm_counters): spares started, their start seconds and the worker's CPU seconds
for them (thread time: Docker's own share of a start is in the docker CPU column), spares
trimmed and expired, resets served from the pool or not. A measurement reports the change of
those counters over it, and the spares pooled at its end with their memory (one-shot stats).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from environments.docker_client import memory_in_use
from poolcore.state import Store

RUN_LABEL = "termpool.run"
COUNTERS = ("claimed", "missed", "started", "start_s", "cpu_s", "upkeep_s", "trimmed", "expired")


def counters(store: Store, host: str) -> dict:
    return store.warm_counters(host)


def cost(store: Store, host: str, before: dict) -> dict:
    """The pool's work since `before` (counters), and its spares now."""
    after = counters(store, host)
    delta = {name: round(after.get(name, 0.0) - before.get(name, 0.0), 3) for name in COUNTERS}
    resets = delta["claimed"] + delta["missed"]
    spares = [entry["client"] for entries in store.warm_pools(host).values() for entry in entries]
    memory = spares_memory(spares)
    return {
        **delta,
        "served_from_pool": round(delta["claimed"] / resets, 3) if resets else None,
        "spares_at_end": len(spares),
        "spares_memory_mb": round(memory / 2**20, 1),
    }


def spares_memory(names: list[str]) -> int:
    """Bytes the named containers use now (in parallel: a one-shot stats call waits for the
    daemon's next sample)."""
    if not names:
        return 0
    with ThreadPoolExecutor(min(16, len(names))) as pool:
        return sum(used or 0 for used in pool.map(memory_in_use, names))


def split_spares(store: Store, containers: list, settle: float = 3.0) -> tuple[list, list]:
    """(others, spares) among a host's containers once every run is closed: a spare is one the
    pool still holds (pooled or starting, Store.warm_known). A container the pool has just let
    go is being removed by it: one still there `settle` seconds later is not a spare."""
    spares = [c for c in containers if _spare(store, c)]
    others = [c for c in containers if c not in spares]
    if any(c.labels.get(RUN_LABEL, "").startswith("warm-") for c in others):
        time.sleep(settle)
        others = [c for c in others if _still_there(c)]
    return others, spares


def _spare(store: Store, container) -> bool:
    run = container.labels.get(RUN_LABEL, "")
    return run.startswith("warm-") and store.warm_known(run)


def _still_there(container) -> bool:
    try:
        container.reload()
        return True
    except Exception:  # docker.errors.NotFound: removed meanwhile
        return False
