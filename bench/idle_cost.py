"""What a host holding many idle runs costs termpool in CPU (issue: a host that runs for weeks).

    python -m bench.idle_cost --runs 512 [--window 180] [--settle 60] [--env KEY=VALUE ...]

One stack (devstack) with beat, as a deployment runs it: every periodic sweep on (the reaper,
the reconcile, the disk check, warm pool sizing, heartbeats), capacity raised to --runs, the
runs never reaped while the benchmark holds them. --runs leases of the one-container fixture
task hello-file are started, left alone --settle seconds (the warm pool's demand fades, the
starts' teardown of spares ends), then CPU-seconds per process group are read over --window
seconds of idleness (bench/monitor.py CpuMeter: each process's whole tree, from /proc).
Nothing polls the facade meanwhile: its CPU is its own.

Reported per group as % of one core (CPU-seconds / wall seconds); "termpool" is the sum of
its own processes (the facade, each worker kind, beat), Redis, Docker and the containers
beside it. The JSON goes to bench/results/idle-cost-<date>.json. Exit status 1 when fewer runs
started than asked or anything was left behind; CPU figures never change it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import density_host as host
from bench.density_runs import Fleet, wait_closed
from bench.monitor import CpuMeter, kind_of
from bench.output import emit, parse_stack_args
from bench.stats import Recorder
from devstack import ROOT, Stack
from environments.docker_client import docker_client

TASK = "hello-file"
OWN = ("facade", "build", "lifecycle", "exec", "eval", "teardown", "beat")  # termpool's processes
SAMPLE_S = 2.0  # how often shims and containers are sampled in the window (the meter's /proc scan)


def stack_env(args) -> dict:
    return {
        "WORKER_MAX_TASKS": "2",
        "WORKER_MAX_RUNS_PER_TASK": str(args.runs + 8),
        "WORKER_RUN_IDLE_TTL": "7200",  # held for the whole benchmark
        "WORKER_ALLOCATED_TTL": "1800",
        "RESET_SESSION_TIMEOUT": "1800",
        **args.extra_env,
    }


def measure(stack: Stack, seconds: float) -> dict:
    """CPU-seconds per group over `seconds` of idleness, sampled every SAMPLE_S."""
    meter = CpuMeter(lambda: {kind_of(name): [p.pid] for name, p in list(stack.procs.items())})
    meter.begin()
    stop = threading.Event()

    def sample():
        while not stop.wait(SAMPLE_S):
            meter.sample()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(seconds)
    stop.set()
    sampler.join()
    return meter.end()


def percents(window: dict) -> dict:
    """% of one core per group, with termpool's own total."""
    wall = window["wall_s"]
    out = {group: round(100 * secs / wall, 2) for group, secs in sorted(window["cpu_s"].items())}
    out["termpool"] = round(sum(out.get(group, 0.0) for group in OWN), 2)
    return out


def table(result: dict) -> str:
    pct = result["cpu_percent_of_one_core"]
    groups = [*OWN, "termpool", "redis", "dockerd", "containerd", "containerd-shim", "containers", "machine"]
    lines = [
        f"{result['live_runs']} idle runs, {result['window']['wall_s']:.0f} s window",
        "| process | % of one core |",
        "|---|---|",
    ]
    lines += [f"| {group} | {pct.get(group, 0.0):.2f} |" for group in groups]
    return "\n".join(lines)


def run(args) -> dict:
    subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], check=True, capture_output=True)
    stack = Stack(env=stack_env(args), beat=True).start()
    fleet, rec, result = Fleet(stack.url, task_key=TASK, parallel=args.start_parallel), Recorder(), {}
    try:
        began = time.monotonic()
        fleet.grow(args.runs, rec)
        result["start_s"] = round(time.monotonic() - began, 1)
        result["live_runs"] = stack.get("/status").json()["pool"]["total_active_runs"]
        result["failures"] = dict(fleet.codes)
        time.sleep(args.settle)
        result["load_before_window"] = host.load_average()
        result["window"] = measure(stack, args.window)
        result["cpu_percent_of_one_core"] = percents(result["window"])
    finally:
        fleet.close_all(rec)
        result["closed"] = wait_closed(stack, 600 + 2.0 * len(fleet.ever))
        fleet.stop()
        stack.stop()
        left = host.left_behind(docker_client(), stack.host_id)
        if any(left.values()):
            result["left_behind"] = left
            host.remove_left(docker_client(), left)
    result["ok"] = result.get("live_runs") == args.runs and not result.get("left_behind") and result["closed"]
    return result


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=512, help="idle runs held")
    p.add_argument("--window", type=float, default=180.0, help="seconds of idleness measured")
    p.add_argument("--settle", type=float, default=60.0, help="seconds left alone before the window")
    p.add_argument("--start-parallel", type=int, default=16, help="resets in flight while starting")
    args = parse_stack_args(p, argv)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    date = time.strftime("%Y%m%d-%H%M", time.gmtime())
    result = {"date": date, "load_before": host.load_average(), **run(args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit("bench.idle_cost", result, out / f"idle-cost-{date}.json")
    if "window" in result:
        print(table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
