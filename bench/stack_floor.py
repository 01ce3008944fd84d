"""The stack's own floor (issue 12, targets 2 and 5): what the same episode costs on a Flask +
gunicorn + Celery + Redis (+ Flower) service that does nothing else (bench/minimal_stack.py).

    python -m bench.stack_floor [--concurrency 1,8] [--repeats 3] [--episodes 32] [--flower]

An episode has the shape of bench.run's pool-API episode, with no Docker behind it:

| termpool call | here |
|---|---|
| allocate, heartbeat x2 | POST /touch: one Redis write |
| reset, 10 tool calls, write_file, evaluate | POST /job: one Celery job, its result awaited |
| close | POST /close: a Redis write and a job nobody waits for |

That is 16 HTTP requests and 14 Celery jobs, as in termpool's. The processes run with the
settings termpool's have: gunicorn gthread with 2 workers, one Celery worker on a thread pool
(termpool runs one per queue kind), and with --flower a Flower that turns the worker's task
events on, plus task-sent events from the facade (termpool sends those while Flower runs).

Reported per concurrency: CPU-seconds per episode of the facade, the worker and Flower
(Redis apart, as bench.run's `termpool` figure), from /proc over the measured window, and the
p50 of each call as the client sees it. Compare with bench.run's figures of the same machine:
CPU per episode here is a floor no Flask + Celery design of this API goes below.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

from bench.episodes import run_phase
from bench.monitor import CpuMeter
from bench.stats import Recorder, percentile
from devstack import Stack, free_port

TOOL_CALLS = 10
PROCESSES = ("facade", "worker", "flower")
OPS = ("allocate", "reset", "heartbeat", "tool_call", "write_file", "evaluate", "close")


def start(stack: Stack, concurrency: int, flower: bool) -> None:
    """The minimal service on the stack's Redis: gunicorn, one Celery worker, Flower if asked."""
    env = {**stack.env, "MINIMAL_REDIS_URL": stack.env["REDIS_URL"], "MINIMAL_SENT_EVENTS": "1" if flower else "0"}
    py = sys.executable
    threads = str(max(64, 2 * concurrency))
    stack._spawn(
        "facade",
        [py, "-m", "gunicorn", "-k", "gthread", "-w", "2", "--threads", threads, "-b", f"127.0.0.1:{stack.port}"]
        + ["bench.minimal_stack:create_app()"],
        env=env,
    )
    worker = [py, "-m", "celery", "-A", "bench.minimal_stack", "worker", "-P", "threads", "-Q", "minimal"]
    stack._spawn("worker", [*worker, "-c", str(max(16, concurrency)), "-l", "WARNING"], env=env)
    if flower:
        stack._spawn(
            "flower",
            [py, "-m", "celery", "-A", "bench.minimal_stack", "flower", "--address=127.0.0.1"]
            + [f"--port={free_port()}"],
            env=env,
        )
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        deadline = time.monotonic() + 60
        while True:  # up once a job goes through: gunicorn, the worker and Redis all answer
            try:
                client.post("/job", json={"id": "warm-up"}).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the minimal stack did not come up; logs in {stack.workdir}") from None
                time.sleep(0.2)
    if flower:
        time.sleep(3)  # Flower turns the worker's events on once it has connected


def episode(client: httpx.Client, index: int, rec: Recorder) -> bool:
    lease = uuid.uuid4().hex

    def call(op: str, path: str) -> None:
        began = time.perf_counter()
        client.post(path, json={"id": lease}).raise_for_status()
        rec.add(op, (time.perf_counter() - began) * 1000)

    try:
        call("allocate", "/touch")
        call("reset", "/job")
        call("heartbeat", "/touch")
        for _ in range(TOOL_CALLS):
            call("tool_call", "/job")
        call("heartbeat", "/touch")
        call("write_file", "/job")
        call("evaluate", "/job")
        call("close", "/close")
    except httpx.HTTPError as exc:
        rec.error(f"{type(exc).__name__}: {exc}")
        return False
    return True


def measure(stack: Stack, concurrency: int, episodes: int) -> dict:
    meter = CpuMeter(lambda: {name: [proc.pid] for name, proc in stack.procs.items()})
    meter.begin()
    rec, wall = run_phase(
        concurrency,
        math.ceil(episodes / concurrency),
        lambda _: httpx.Client(base_url=stack.url, timeout=60),
        lambda client, index, rec: episode(client, index, rec),
        lambda client: client.close(),
    )
    time.sleep(1)  # the last close's job
    cpu = meter.end()["cpu_s"]
    done = max(1, rec.episodes_ok)
    per_episode = {name: round(cpu.get(name, 0.0) / done, 4) for name in (*PROCESSES, "redis")}
    per_episode["stack"] = round(sum(per_episode[name] for name in PROCESSES), 4)
    return {
        "episodes": rec.episodes_ok,
        "errors": rec.error_count,
        "episodes_per_s": round(rec.episodes_ok / wall, 2),
        "cpu_s_per_episode": per_episode,
        "p50_ms": {op: round(percentile(rec.samples[op], 50), 2) for op in OPS if rec.samples[op]},
    }


def median_dicts(repeats: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in repeats), 4) for key in repeats[0]}


def report(results: dict) -> str:
    lines = [
        "| c | "
        + " | ".join(f"CPU-s/ep {p}" for p in (*PROCESSES, "stack"))
        + " | "
        + " | ".join(f"{op} p50 ms" for op in OPS)
        + " | errors |",
        "|---" * (len(PROCESSES) + len(OPS) + 3) + "|",
    ]
    for level, figures in results.items():
        cpu = figures["cpu_s_per_episode"]
        lines.append(
            f"| {level} | "
            + " | ".join(f"{cpu[p]:.3f}" for p in (*PROCESSES, "stack"))
            + " | "
            + " | ".join(f"{figures['p50_ms'].get(op, float('nan')):.1f}" for op in OPS)
            + f" | {figures['errors']} |"
        )
    return "\n".join(lines)


def run(levels: list[int], repeats: int, episodes: int, flower: bool) -> dict:
    """Medians over repeats per concurrency level, on a minimal stack of its own."""
    stack = Stack()
    results: dict = {}
    try:
        stack.start_redis()
        start(stack, max(levels), flower)
        for level in levels:
            runs = [measure(stack, level, episodes) for _ in range(repeats)]
            results[level] = {
                "episodes": sum(r["episodes"] for r in runs),
                "errors": sum(r["errors"] for r in runs),
                "episodes_per_s": statistics.median(r["episodes_per_s"] for r in runs),
                "cpu_s_per_episode": median_dicts([r["cpu_s_per_episode"] for r in runs]),
                "p50_ms": median_dicts([r["p50_ms"] for r in runs]),
            }
    finally:
        stack.stop()
    return {"flower": flower, "repeats": repeats, "episodes": episodes, "levels": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--episodes", type=int, default=32, help="episodes per measurement")
    p.add_argument("--flower", action="store_true", help="with Flower running (its events on)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, not {args.concurrency!r}")
    if not levels or min(levels) < 1 or args.repeats < 1 or args.episodes < 1:
        p.error("concurrency levels, --repeats and --episodes must be positive")
    figures = run(levels, args.repeats, args.episodes, args.flower)
    print(
        f"minimal Flask + Celery stack, {'with' if args.flower else 'without'} Flower; "
        f"medians of {args.repeats} repeats of {args.episodes} episodes"
    )
    print(report(figures["levels"]))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    sys.exit(1 if any(r["errors"] for r in figures["levels"].values()) else 0)


if __name__ == "__main__":
    main()
