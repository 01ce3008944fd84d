"""Cold resets through the pool API against raw create+start, in interleaved pairs (issue 23,
target 3).

    python -m bench.resets [--concurrency 8,32] [--rounds 5] [--flower]

Per concurrency c and round: c threads at once do a raw `containers.create` + `start` with the
options of termpool's direct start (bench/episodes.py's Floor), then the containers go; then c
threads at once allocate a lease and reset it through the pool API (the warm pool off: every
reset starts a container), timed from the reset's request to its answer; then the leases close
and the teardowns end. Nothing else runs beside either side, unlike bench.run's episodes, where
each side's other steps share the machine with its resets in different proportions. Reports
per c the median over rounds of each side's p50 (and p95), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.episodes import Floor
from bench.output import emit
from bench.run import start_flower
from bench.stats import percentile
from devstack import FIXTURES, Stack
from devstack.threads import at_once
from environments import compose_config
from environments.docker_client import docker_client
from poolcore.config import load_settings

TASK = "hello-file"
LABEL = "termpool.bench-resets"


def _timed_together(concurrency: int, one) -> list[float]:
    samples, lock = [], threading.Lock()

    def timed() -> None:
        began = time.perf_counter()
        one()
        with lock:
            samples.append((time.perf_counter() - began) * 1000)

    errors = at_once(concurrency, timed)
    if errors:
        raise RuntimeError(f"{len(errors)} of {concurrency} failed, first: {errors[0]!r}")
    return samples


def floor_round(floor: Floor, workdir: Path, concurrency: int) -> list[float]:
    def one() -> None:
        name = "tprs-floor-" + uuid.uuid4().hex[:10]
        run_dir = workdir / name
        for sub in ("sessions", "agent-logs"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        floor.create_start(name, run_dir)

    try:
        return _timed_together(concurrency, one)
    finally:
        for container in docker_client().containers.list(all=True, filters={"label": LABEL}, sparse=True):
            container.remove(force=True, v=True)


def pool_round(stack: Stack, concurrency: int, round_no: int) -> list[float]:
    leases = [stack.client.allocate(f"{TASK}#r{round_no}-{i // 8}") for i in range(concurrency)]
    pending = list(leases)
    lock = threading.Lock()

    def one() -> None:
        with lock:
            lease = pending.pop()
        lease.reset(TASK)

    try:
        return _timed_together(concurrency, one)
    finally:
        for lease in leases:
            lease.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the teardowns end before the next round
            pool = stack.get("/status").json()["pool"]
            if not pool["total_active_runs"] and not pool["pending_closes"]:
                break
            time.sleep(0.1)


def measure(levels: list[int], rounds: int, flower: bool) -> dict:
    top = str(max(max(levels), 8))
    env = {"WARM_POOL_SIZE": "0", "LIFECYCLE_CONCURRENCY": top, "TEARDOWN_CONCURRENCY": top, "WEB_THREADS": "64"}
    stack = Stack(env=env, beat=True).start()
    workdir = Path(tempfile.mkdtemp(prefix="tp-resets-"))
    results = {}
    try:
        if flower:
            start_flower(stack)
        cfg = load_settings(stack.env)
        floor = Floor(
            docker_client(),
            compose_config.client_image(TASK, cfg),
            cfg.container_memory_limit,
            FIXTURES / TASK,
            workdir,
            {LABEL: "1"},
        )
        warm = stack.client.allocate(f"{TASK}#warm-up")
        warm.reset(TASK)  # builds the image once; not timed
        warm.close()
        for c in levels:
            runs = [(floor_round(floor, workdir, c), pool_round(stack, c, r)) for r in range(rounds)]
            results[c] = summarize(runs)
    finally:
        stack.stop()
    return {"rounds": rounds, "flower": flower, "levels": results}


def summarize(runs: list[tuple[list, list]]) -> dict:
    def median_of(side: int, q: float) -> float:
        return round(statistics.median(percentile(r[side], q) for r in runs), 1)

    floor_p50, pool_p50 = median_of(0, 50), median_of(1, 50)
    return {
        "floor_create_start_ms": {"p50": floor_p50, "p95": median_of(0, 95)},
        "termpool_reset_ms": {"p50": pool_p50, "p95": median_of(1, 95)},
        "ratio_p50": round(pool_p50 / floor_p50, 3),
        "per_round_p50_ms": [[round(percentile(f, 50)), round(percentile(p, 50))] for f, p in runs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--flower", action="store_true", help="with Flower running")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args()
    levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    emit("bench.resets", measure(levels, args.rounds, args.flower), args.out)


if __name__ == "__main__":
    main()
