"""termpool's benchmark: whole episodes through the pool API and the runs API against the raw
Docker SDK doing the same work (the floor), at several concurrency levels. See bench/README.md.

    python -m bench.run [--quick] [--repeats N] [--concurrency 1,8,32,128] [--out bench/results]
                        [--tool-calls N] [--episodes N] [--env KEY=VALUE ...]

Exit status: 0 when every termpool episode succeeded and no container was leaked; 1 otherwise;
2 when the benchmark could not set up (no Docker, no base image, the stack did not start).
Timings never change the exit status, nor do failures of the floor's raw SDK calls (reported).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import docker
import psutil
import requests

from bench import report, report_chart, stack_floor, warm
from bench.episodes import TASK, BenchClient, Floor, pool_episode, run_phase, runs_api_available, runs_episode
from bench.monitor import Monitor
from bench.stats import Recorder
from devstack import FIXTURES, ROOT, Stack, free_port
from poolcore.config import load_settings
from poolcore.state import Store
from poolcore.task_spec import image_name

FACES = ("floor", "pool", "runs")
DRAIN_TIMEOUT = 300.0
HOST_LABEL = "termpool.host"
RUN_LABEL = "termpool.run"
BENCH_LABEL = "termpool.bench"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- command line ---------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="CI smoke run: concurrency 1,8, 1 repeat, 3 tool calls, 2 episodes at c=1"
    )
    p.add_argument("--repeats", type=int, help="times each measurement is repeated (default 3; quick 1)")
    p.add_argument("--concurrency", help="comma-separated concurrent episodes (default 1,8,32,128; quick 1,8)")
    p.add_argument("--tool-calls", type=int, help="`echo hi` tool calls per episode (default 10; quick 3)")
    p.add_argument(
        "--episodes",
        type=int,
        help="at least this many episodes per measurement; each of the c workers runs "
        "ceil(episodes/c) (default 8; quick 2)",
    )
    p.add_argument(
        "--out", default=str(ROOT / "bench" / "results"), help="folder for <timestamp>.json/.png and latest.*"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the stack (repeatable), e.g. --env WARM_POOL_SIZE=8",
    )
    p.add_argument("--skip-runs-api", action="store_true", help="measure the pool API and the floor only")
    p.add_argument("--flower", action="store_true", help="run Flower against the stack, as a deployment does")
    p.add_argument("--no-beat", action="store_true", help="do not run Celery beat (the reaper's schedule)")
    p.add_argument(
        "--stack-floor",
        action="store_true",
        help="also measure the same episodes on a minimal Flask + Celery stack (bench/stack_floor.py), "
        "after termpool's, for the CPU ratio against it",
    )
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.tool_calls = args.tool_calls if args.tool_calls is not None else (3 if args.quick else 10)
    args.episodes = args.episodes or (2 if args.quick else 8)
    levels = args.concurrency or ("1,8" if args.quick else "1,8,32,128")
    try:
        args.levels = sorted({int(x) for x in levels.split(",") if x.strip()})
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, not {levels!r}")
    if not args.levels or min(args.levels) < 1 or args.repeats < 1 or args.tool_calls < 0 or args.episodes < 1:
        p.error("concurrency levels, --repeats and --episodes must be positive, --tool-calls not negative")
    args.extra_env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--env wants KEY=VALUE, not {item!r}")
        args.extra_env[key] = value
    return args


def stack_env(levels: list[int], extra: dict) -> dict:
    """Worker pools and web threads sized so the highest level never waits on a pool."""
    top = max(levels)
    env = {
        "EXEC_CONCURRENCY": str(max(16, top)),
        "LIFECYCLE_CONCURRENCY": str(max(8, top)),
        "EVAL_CONCURRENCY": str(max(8, top)),
        "TEARDOWN_CONCURRENCY": str(max(4, top)),
        "WEB_THREADS": str(max(64, 2 * top)),
    }
    runs_per_key = int(extra.get("WORKER_MAX_RUNS_PER_TASK", "8"))
    if math.ceil(top / runs_per_key) > 16:
        env["WORKER_MAX_TASKS"] = str(math.ceil(top / runs_per_key))
    env.update(extra)
    return env


# ---- one measurement ------------------------------------------------------------------------
def phase_record(rec: Recorder, wall: float, **extra) -> dict:
    return {
        "samples": {op: list(v) for op, v in rec.samples.items()},
        "wall_s": round(wall, 3),
        "episodes": rec.episodes_ok,
        "episodes_failed": rec.episodes_failed,
        "episodes_per_s": round(rec.episodes_ok / wall, 3) if wall > 0 else None,
        "error_count": rec.error_count,
        "error_messages": rec.error_messages,
        **extra,
    }


def start_flower(stack: Stack) -> None:
    """Flower on a free loopback port, as the Procfile runs it (python -m tasks.flower), kept in
    stack.procs so that the monitor counts it and stack.stop() ends it."""
    port = free_port()
    stack.env.update(FLOWER_PORT=str(port), FLOWER_ADDRESS="127.0.0.1")  # read by Flower only
    stack._spawn("flower", [sys.executable, "-m", "tasks.flower"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthcheck", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"flower did not come up; log in {stack.workdir}/flower.log")


# ---- termpool's leftovers -------------------------------------------------------------------
def drain(stack: Stack, timeout: float = DRAIN_TIMEOUT) -> dict:
    """Wait until no run is live and no teardown is pending; return the last /status pool."""
    deadline = time.monotonic() + timeout
    pool: dict = {}
    while time.monotonic() < deadline:
        try:
            pool = stack.client.status()
            if pool.get("total_active_runs") == 0 and pool.get("pending_closes") == 0:
                return pool
        except Exception:
            pass
        time.sleep(0.5)
    return pool


def leftovers(client, label: str) -> list[str]:
    return sorted(c.name for c in client.containers.list(all=True, filters={"label": label}))


def termpool_leftovers(client, host_label: str, store: Store) -> tuple[list, list]:
    """(leaked, spares) among the containers of the stack's host once every run is closed: a
    spare is one the warm pool still holds (bench/warm.py); every other one is leaked."""
    containers = client.containers.list(all=True, filters={"label": host_label}, ignore_removed=True)
    leaked, spares = warm.split_spares(store, containers)
    return sorted(c.name for c in leaked), sorted(c.name for c in spares)


def remove_named(client, names: list[str]) -> None:
    for name in names:
        try:
            client.containers.get(name).remove(force=True, v=True)
        except docker.errors.APIError:
            pass


def remove_all(client, label: str) -> None:
    for container in client.containers.list(all=True, filters={"label": label}):
        try:
            container.remove(force=True, v=True)
        except docker.errors.APIError:
            pass


def log_problems(stack: Stack) -> dict:
    """Lines that say ERROR or Traceback in each process's log (count and the first few)."""
    out = {}
    for path in sorted(stack.workdir.glob("*.log")):
        lines = [
            line
            for line in path.read_text(errors="replace").splitlines()
            if "Traceback" in line or " ERROR" in line or "ERROR/" in line or "CRITICAL" in line
        ]
        if lines:
            out[path.stem] = {"count": len(lines), "first": [line[:300] for line in lines[:3]]}
    return out


# ---- the whole benchmark --------------------------------------------------------------------
def machine_info(dclient) -> dict:
    try:
        docker_version = dclient.version().get("Version")
    except Exception:
        docker_version = None
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "docker": docker_version,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    started_at = time.time()
    env = stack_env(args.levels, args.extra_env)
    runs_per_key = int(env.get("WORKER_MAX_RUNS_PER_TASK", "8"))

    try:
        dclient = docker.from_env(timeout=600, max_pool_size=max(32, 2 * max(args.levels)))
        dclient.ping()
    except Exception as exc:
        log(f"cannot talk to Docker: {exc}")
        return 2
    proc = subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"tests/base_image.sh failed: {proc.stderr.strip()[-2000:]}")
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="termpool-bench-"))
    bench_id = uuid.uuid4().hex[:8]
    floor_label = f"{BENCH_LABEL}={bench_id}"
    result: dict = {
        "version": 1,
        "started_at": dt.datetime.fromtimestamp(started_at).isoformat(timespec="seconds"),
        "command": ["python", "-m", "bench.run", *(sys.argv[1:] if argv is None else argv)],
        "quick": args.quick,
        "config": {
            "concurrency": args.levels,
            "repeats": args.repeats,
            "tool_calls": args.tool_calls,
            "episodes": args.episodes,
            "task": TASK,
            "stack_env": env,
            "env_overrides": args.extra_env,
            "runs_per_task_key": runs_per_key,
            "monitor_interval_s": 0.5,
            "flower": args.flower,
            "beat": not args.no_beat,
        },
        "machine": machine_info(dclient),
    }
    log(f"starting the stack (logs in {workdir}/stack); stack env {env}")
    stack = Stack(env=env, beat=not args.no_beat, workdir=workdir / "stack")
    monitor = None
    raw: dict = {}  # level -> face -> [phase record per repeat]
    termpool_leaks: set[str] = set()
    warm_size = load_settings(env).warm_pool_size  # the warm pool is on unless WARM_POOL_SIZE=0
    result["config"]["warm_pool_size"] = warm_size
    floor_leaks: set[str] = set()
    warmup_errors: dict = {"count": 0, "first": []}  # termpool's faces
    warmup_floor_errors: dict = {"count": 0, "first": []}
    result["warmup_errors"] = warmup_errors
    try:
        try:
            stack.start()
            if args.flower:
                start_flower(stack)
        except Exception as exc:
            log(f"the stack did not start: {exc}")
            result["setup_error"] = str(exc)
            return 2
        result["config"]["host_id"] = stack.host_id
        log(f"stack up: {stack.url}, POOL_HOST_ID {stack.host_id}")
        result["stack_logs"] = str(stack.workdir)
        host_label = f"{HOST_LABEL}={stack.host_id}"
        store = Store(stack.redis)
        monitor = Monitor(stack.procs, stack.url).start()

        available, why = runs_api_available(stack.client)
        if args.skip_runs_api:
            available, why = False, "skipped with --skip-runs-api"
        result["runs_api"] = {"available": available, "note": why}
        faces = [f for f in FACES if f != "runs" or available]
        if not available:
            log(f"runs API not measured: {why}")

        mem_limit = stack.env["CONTAINER_MEMORY_LIMIT"]
        floor = Floor(dclient, image_name(TASK), mem_limit, FIXTURES / TASK, workdir / "floor", {BENCH_LABEL: bench_id})

        def key_for(index: int) -> str:
            return f"{TASK}#{index // runs_per_key}"

        def new_client(_):
            return BenchClient(stack.url)

        episode_fns = {
            "floor": (lambda i: floor, lambda ctx, i, rec: ctx.episode(rec, args.tool_calls), None),
            "pool": (
                new_client,
                lambda ctx, i, rec: pool_episode(ctx, rec, key_for(i), args.tool_calls),
                lambda ctx: ctx.close(),
            ),
            "runs": (
                new_client,
                lambda ctx, i, rec: runs_episode(ctx, rec, key_for(i), args.tool_calls),
                lambda ctx: ctx.close(),
            ),
        }

        # Warm-up: the first reset builds the task image (the floor needs it too); one episode
        # of each face, not timed, so no measurement pays for a build or a cold cache.
        monitor.set_phase("warmup")
        log("warm-up: one episode per face (the first reset builds the image if needed)")
        for face in ("pool", "runs", "floor"):
            if face not in faces:
                continue
            make_ctx, episode, close_ctx = episode_fns[face]
            rec, wall = run_phase(1, 1, make_ctx, episode, close_ctx)
            log(f"  warm-up {face}: {wall:.1f} s, {rec.error_count} errors")
            bucket = warmup_floor_errors if face == "floor" else warmup_errors
            bucket["count"] += rec.error_count
            bucket["first"] += [f"warm-up {face}: {m}" for m in rec.error_messages]
        drain(stack)
        remove_all(dclient, floor_label)

        for level in args.levels:
            if math.ceil(level / runs_per_key) > int(env.get("WORKER_MAX_TASKS", "16")):
                log(f"concurrency {level} exceeds the stack's capacity; skipped")
                result.setdefault("skipped_levels", []).append(level)
                continue
            per_worker = max(1, math.ceil(args.episodes / level))
            raw[level] = {face: [] for face in faces}
            if warm_size:  # steady state: the timed repeats find the pool sized for this level
                monitor.set_phase(f"prime@{level}")
                make_ctx, episode, close_ctx = episode_fns["pool"]
                rec, wall = run_phase(level, 1, make_ctx, episode, close_ctx)
                log(f"  priming the warm pool at c={level}: {wall:.1f} s, {rec.error_count} errors")
                warmup_errors["count"] += rec.error_count
                warmup_errors["first"] += [f"prime c={level}: {m}" for m in rec.error_messages]
                drain(stack)
            for repeat in range(1, args.repeats + 1):
                for face in faces:
                    phase = f"{face}@{level}#{repeat}"
                    monitor.set_phase(phase)
                    make_ctx, episode, close_ctx = episode_fns[face]
                    monitor.cpu_begin()
                    pool_before = warm.counters(store, stack.host_id)
                    rec, wall = run_phase(level, per_worker, make_ctx, episode, close_ctx)
                    monitor.set_phase("drain")
                    leaked: list[str] = []
                    drained_in = pool_cost = None
                    if face == "floor":
                        cpu = monitor.cpu_end()
                        leaked = leftovers(dclient, floor_label)
                        floor_leaks.update(leaked)
                        remove_all(dclient, floor_label)
                    else:
                        t0 = time.monotonic()
                        pool = drain(stack)
                        cpu = monitor.cpu_end()  # teardowns included: they are part of an episode
                        drained_in = round(time.monotonic() - t0, 2)
                        pool_cost = warm.cost(store, stack.host_id, pool_before)
                        leaked, spares = termpool_leftovers(dclient, host_label, store)
                        if pool.get("total_active_runs") or pool.get("pending_closes"):
                            rec.error(
                                f"{face}: not drained after {DRAIN_TIMEOUT:g} s: /status pool {json.dumps(pool)[:300]}"
                            )
                        termpool_leaks.update(leaked)
                        remove_named(dclient, leaked)  # measure the next phase on a clean host
                    peak = monitor.peak(phase)
                    if pool_cost:
                        log(
                            f"  warm pool: {pool_cost['claimed']:.0f} resets served, {pool_cost['missed']:.0f} "
                            f"missed; {pool_cost['started']:.0f} spares started ({pool_cost['start_s']:.1f} s, "
                            f"{pool_cost['cpu_s']:.2f} CPU-s in the worker), {pool_cost['trimmed']:.0f} trimmed, "
                            f"{pool_cost['expired']:.0f} expired; {len(spares)} spares at the end using "
                            f"{pool_cost['spares_memory_mb']:.0f} MB"
                        )
                    raw[level][face].append(
                        phase_record(
                            rec,
                            wall,
                            leaked=leaked,
                            drain_s=drained_in,
                            memory=peak,
                            cpu=cpu,
                            warm_pool=pool_cost,
                            repeat=repeat,
                            phase=phase,
                        )
                    )
                    per_episode = report.cpu_per_episode(cpu, rec.episodes_ok)
                    log(
                        f"{face:5s} c={level:<3d} repeat {repeat}/{args.repeats}: {rec.episodes_ok} episodes "
                        f"in {wall:.1f} s ({rec.episodes_ok / wall if wall else 0:.2f}/s), {rec.error_count} errors, "
                        f"{len(leaked)} leaked, peak RSS {peak['total_mb']:.0f} MB, live runs {peak['live_runs']}; "
                        f"CPU-s/episode termpool {per_episode.get('termpool')}, docker {per_episode.get('docker')}, "
                        f"machine {per_episode.get('machine')}"
                    )
        # Anything termpool left behind once every run is closed and torn down.
        monitor.set_phase("final")
        final_pool = drain(stack)
        result["final_status"] = final_pool
        leaked, spares = termpool_leftovers(dclient, host_label, store)
        termpool_leaks.update(leaked)
        result["warm_spares_at_end"] = spares
        result["warm_pool_counters"] = warm.counters(store, stack.host_id)
    finally:
        if monitor:
            monitor.stop()
        stack.stop()
        host_label = f"{HOST_LABEL}={stack.host_id}"
        after_stop = leftovers(dclient, host_label)
        result["left_after_stop"] = after_stop
        termpool_leaks.update(after_stop)  # a clean stop removes the warm pool's spares too
        floor_leaks.update(leftovers(dclient, floor_label))
        remove_all(dclient, host_label)
        remove_all(dclient, floor_label)

    result["log_problems"] = log_problems(stack)
    if args.stack_floor:
        log("the stack floor: the same episodes on a minimal Flask + Celery stack (bench/stack_floor.py)")
        try:
            result["stack_floor"] = stack_floor.run(args.levels, args.repeats, max(args.episodes, 32), args.flower)
        except Exception as exc:  # a figure missing, not a failed run: termpool's figures stand
            log(f"the stack floor was not measured: {type(exc).__name__}: {exc}")
            result["stack_floor"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["finished_at"] = dt.datetime.now().isoformat(timespec="seconds")
    result["duration_s"] = round(time.time() - started_at, 1)
    summary = report.summarize_run(raw, monitor, args.levels)
    result.update(summary)
    result["leaked_containers"] = sorted(termpool_leaks)
    result["floor_leftovers"] = sorted(floor_leaks)
    # Errors of the floor are Docker's own (e.g. exec_run's known lost output, moby#27289):
    # reported, but only termpool's errors and leaks fail the run.
    result["floor_errors"]["count"] += warmup_floor_errors["count"]
    result["floor_errors"]["first"] = (warmup_floor_errors["first"] + result["floor_errors"]["first"])[:10]
    total_errors = result["errors"]["count"] + result["warmup_errors"]["count"]
    exit_code = 1 if total_errors or termpool_leaks else 0
    result["errors"]["count_with_warmup"] = total_errors
    result["targets"] = report.targets(result)
    result["exit_code"] = exit_code

    json_path = out_dir / f"{stamp}.json"
    json_path.write_text(json.dumps(result, indent=1))
    # Every sample (ms, 0.1 ms), for re-analysis: level -> face -> [repeat -> op -> [ms]].
    samples = {
        str(lv): {
            face: [{op: [round(v, 1) for v in vals] for op, vals in r["samples"].items()} for r in reps]
            for face, reps in faces.items()
        }
        for lv, faces in raw.items()
    }
    (out_dir / f"{stamp}-samples.json").write_text(json.dumps(samples))
    shutil.copyfile(json_path, out_dir / "latest.json")
    try:
        png = report_chart.chart(result, out_dir / f"{stamp}.png")
        shutil.copyfile(png, out_dir / "latest.png")
    except Exception as exc:  # a chart failure must not hide the figures
        log(f"chart failed: {type(exc).__name__}: {exc}")
    text = report.table(result)
    (out_dir / f"{stamp}.md").write_text(text + "\n")
    shutil.copyfile(out_dir / f"{stamp}.md", out_dir / "latest.md")
    print(text)
    log(f"results: {json_path} (and latest.json / latest.png in {out_dir})")
    shutil.rmtree(workdir / "floor", ignore_errors=True)
    if exit_code:
        log(f"exit 1: {total_errors} errors, {len(termpool_leaks)} leaked containers")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
