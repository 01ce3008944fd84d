"""A host full of runs (issue 29, parts 3 and 4): many live runs of the two-service fixture task
on one host, their memory, and latency at density against floors measured in the same run.

    python -m bench.density [--phases density,latency,storm] [--levels 64,128,256]
                            [--live 128] [--in-flight 32] [--storm 128] [--repeats 3] [--profile]

One stack (devstack), capacity raised to the largest phase, the warm pool off (it serves
one-service tasks only), one task key. Phases, in this order, each ending with every run closed
and the host checked for anything left behind (containers, networks, volumes labelled with the
stack's host id, networks of the runs' compose projects):

- density: runs are started (--start-parallel at a time) up to each N of --levels; at each N,
  with all N live, every run answers a tool call that reaches its own sidecar by service name
  (the N replies must name N different sidecars), then memory is read: termpool's processes
  (RSS by kind, Redis included), the containers (cgroup), Docker's processes (daemons, shims)
  and the machine's MemAvailable, each less its value before the first run, per run.
- latency: first one episode at a time with nothing else live (c=1 alone); then --live minus
  --in-flight runs are started and held idle, and per repeat: one episode at a time beside them
  (c=1), then --in-flight episodes at once (--live runs live). An episode: reset, --tool-calls
  `echo hi`, the sidecar probe (writes the answer), evaluate (1.0), close.
- storm: per repeat, --storm raw two-service starts at once (the floor: network, sidecar,
  client, straight SDK calls; bench/density_host.py), then --storm resets at once through the
  pool API; each side's total time from the release to the last answer.

Figures are medians over repeats of each repeat's own; ratios are paired within a repeat.
--profile runs py-spy on the facade and the workers through the loaded latency window and the
storm (bench/profile.py), beside CPU-seconds by process group (bench/monitor.py). Exit status 1
when any run failed or anything was left behind; timings never change it.
"""

from __future__ import annotations

import argparse
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import density_host as host
from bench import profile
from bench.density_report import markdown
from bench.density_runs import TASK, Fleet, episode, wait_closed
from bench.episodes import Floor, run_phase
from bench.monitor import Monitor
from bench.output import emit, parse_stack_args
from bench.stats import Recorder, percentile
from devstack import FIXTURES, ROOT, Stack
from environments import compose_config
from environments.docker_client import docker_client
from environments.lifecycle import run_name
from poolcore.config import load_settings
from poolcore.task_spec import name_prefix

PROFILED = ("web", "lifecycle", "exec", "teardown")
SPY_RATE = 50  # py-spy samples per second: 50 samples = 1 CPU-second of Python holding the GIL
SETTLE_S = 5.0  # after the probes, before memory is read: the runs idle


class Bench:
    """The stack and what every phase shares: its monitor, the Docker client, the findings."""

    def __init__(self, args):
        self.args = args
        top = max([*args.levels, args.live, args.storm])
        env = {
            "WARM_POOL_SIZE": "0",
            "WORKER_MAX_TASKS": "2",
            "WORKER_MAX_RUNS_PER_TASK": str(top + 8),
            "WORKER_RUN_IDLE_TTL": "7200",  # held runs idle for the whole benchmark
            "WORKER_ALLOCATED_TTL": "1800",  # a storm's leases wait for their resets
            "RESET_SESSION_TIMEOUT": "1800",
            **args.extra_env,
        }
        self.stack = Stack(env=env, beat=True).start()
        self.cfg = load_settings(self.stack.env)
        self.docker = docker_client()
        # Sampled less often than bench.run's monitor: with a thousand containers, a scan of
        # /proc every 0.25 s would cost the machine half a core.
        self.monitor = Monitor(self.stack.procs, self.stack.url, interval=2.0, cpu_interval=1.0).start()
        self.workdir = Path(tempfile.mkdtemp(prefix="tp-density-"))
        self.left: dict[str, dict] = {}  # phase -> what it left behind
        self.failures: dict[str, dict] = {}  # phase -> failed operations by "<op> <code>"
        self.floor_failures: list[list[str]] = []
        self.closes: dict[str, dict] = {}  # phase -> runs closed at its end, seconds to the last teardown

    def fleet(self) -> Fleet:
        return Fleet(self.stack.url, parallel=self.args.start_parallel)

    def phase(self, name: str) -> None:
        """The monitor's phase label, and a progress line on stderr (the JSON is on stdout)."""
        self.monitor.set_phase(name)
        print(f"{time.strftime('%H:%M:%S')} {name} (load {host.load_average()})", file=sys.stderr, flush=True)

    def warm_up(self) -> None:
        """One episode before anything is timed: the task's images are built here."""
        fleet, rec = self.fleet(), Recorder()
        episode(fleet, rec, 1, 0.0)
        self._end_phase("warm-up", fleet, rec)

    def _end_phase(self, phase: str, fleet: Fleet, rec: Recorder) -> None:
        """Close what is still live, wait for the teardowns, and look for leftovers."""
        began, closing = time.monotonic(), len(fleet.leases)
        fleet.close_all(rec)
        fleet.stop()
        limit = 600 + 3 * closing  # a host tears down a few runs a second at best
        if not wait_closed(self.stack, limit):
            rec.error(f"teardowns still pending {limit} s after the close of {closing} runs")
        self.closes[phase] = {"runs": closing, "seconds": round(time.monotonic() - began, 1)}
        projects = [run_name(TASK, lease) for lease in fleet.ever]
        left = host.left_behind(self.docker, self.stack.host_id, projects)
        if any(left.values()):
            self.left[phase] = left
            host.remove_left(self.docker, left)
        self.note(phase, rec, fleet.codes)

    def note(self, phase: str, rec: Recorder, codes: dict | None = None) -> None:
        """A phase's failed operations: by "<op> <code>", and the first messages."""
        if codes or rec.error_count:
            found = self.failures.setdefault(phase, {"errors": 0, "first": []})
            found.update(codes or {})
            found["errors"] += rec.error_count
            found["first"] = (found["first"] + rec.error_messages)[:5]

    # ---- what the host holds ------------------------------------------------------------------
    def snapshot(self) -> dict:
        termpool = self.monitor.rss_by_kind()
        return {
            "termpool_mb": {"total": round(sum(termpool.values()), 1), **{k: round(v, 1) for k, v in termpool.items()}},
            "redis_used_mb": round(self.stack.redis.info("memory")["used_memory"] / host.MB, 1),
            "containers": host.containers_memory(self.docker, self.stack.host_id),
            "docker_daemons_mb": host.docker_daemons_mb(),
            "mem_available_mb": host.mem_available_mb(),
            "load": host.load_average(),
            "status": self.host_status(),
        }

    def host_status(self) -> dict:
        """This host's live runs from /status, and its networks when /status reports them."""
        pool = self.stack.get("/status").json()["pool"]
        mine = pool.get("hosts", {}).get(self.stack.host_id, {})
        return {"live_runs": mine.get("live_runs"), **({"networks": mine["networks"]} if "networks" in mine else {})}

    # ---- windows with CPU and (with --profile) py-spy ------------------------------------------
    def window(self, name: str, fn, profiled: bool) -> tuple:
        """fn() with CPU-seconds by process group over it and, if profiled, py-spy's view."""
        spies = self._spy_start(name) if profiled and self.args.profile else {}
        self.monitor.cpu_begin()
        try:
            value = fn()
        finally:
            cpu = self.monitor.cpu_end()
            found = self._spy_end(spies)
        return value, {**cpu, **({"python": found} if found else {})}

    def _spy_start(self, name: str) -> dict:
        out = self.workdir / "profile"
        return {
            proc: (
                profile.record(self.stack.procs[proc].pid, out / f"{name}-{proc}.txt", 3600, SPY_RATE),
                out / f"{name}-{proc}.txt",
            )
            for proc in PROFILED
        }

    def _spy_end(self, spies: dict) -> dict:
        found = {}
        for spy, _ in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
        for proc, (spy, raw) in spies.items():
            spy.wait(timeout=120)
            summary = profile.consumers(profile.read_stacks(raw), 8)
            found[proc] = {
                "python_cpu_s": round(summary["samples"] / SPY_RATE, 2),
                "by_package_s": {p: round(n / SPY_RATE, 2) for p, n in summary["by_package"]},
                "leaf_s": [[frame[:140], round(n / SPY_RATE, 2)] for frame, n in summary["leaf"][:5]],
            }
        return found

    def stop(self) -> None:
        self.monitor.stop()
        self.stack.stop()
        left = host.left_behind(self.docker, self.stack.host_id)
        if any(left.values()):
            self.left["after stop"] = left
            host.remove_left(self.docker, left)


# ---- part 3: density --------------------------------------------------------------------------
def density(bench: Bench) -> dict:
    fleet, rec = bench.fleet(), Recorder()
    base, rows = bench.snapshot(), []
    try:
        for n in bench.args.levels:
            bench.phase(f"density@{n}")
            grown = fleet.grow(n, rec)
            level = Recorder()  # this level's probes
            sides = fleet.probe_all(level)
            bench.note("density", level)
            time.sleep(SETTLE_S)
            _, idle = bench.window(f"idle@{n}", lambda: time.sleep(bench.args.idle_seconds), False)
            rows.append(level_row(n, base, bench.snapshot(), sides, level, grown, fleet, bench.monitor))
            rows[-1]["idle_cpu"] = idle
            if rows[-1]["answered"] < n or rows[-1]["distinct_sidecars"] < n:
                rec.error(f"at {n}: {rows[-1]['answered']} runs answered, {rows[-1]['distinct_sidecars']} sidecars")
                break  # the next level would only say so again
    finally:
        bench._end_phase("density", fleet, rec)
    return {"before": base, "levels": rows}


def level_row(n: int, base: dict, snap: dict, sides: dict, probes: Recorder, grown: float, fleet, monitor) -> dict:
    live = len(fleet.leases)
    answered = [side for side in sides.values() if side]
    calls = probes.samples.get("probe") or []
    return {
        "n": n,
        "live": live,
        "answered": len(answered),
        "distinct_sidecars": len(set(answered)),
        "start_s": round(grown, 1),
        "probe_ms": {"p50": round(percentile(calls, 50)), "p95": round(percentile(calls, 95))} if calls else {},
        "per_run_mb": per_run(base, snap, live),
        "snapshot": snap,
        "peak": monitor.peak(f"density@{n}"),
    }


def per_run(base: dict, snap: dict, live: int) -> dict:
    """Memory per live run: each owner's growth since before the first run, over the runs."""
    if not live:
        return {}

    def grown(path: tuple) -> float:
        a, b = base, snap
        for key in path:
            a, b = a.get(key, 0), b.get(key, 0)
        return round((b - a) / live, 2)

    services = snap["containers"]["by_service_mb"]
    out = {
        "termpool": grown(("termpool_mb", "total")),
        "redis_rss": grown(("termpool_mb", "redis")),
        "redis_used": grown(("redis_used_mb",)),
        "containers": grown(("containers", "total_mb")),
        **{f"container_{name}": round(mb / live, 2) for name, mb in services.items()},
        "docker_shims": grown(("containers", "shims_mb")),
        "docker_daemons": grown(("docker_daemons_mb",)),
        "host_mem_available": round((base["mem_available_mb"] - snap["mem_available_mb"]) / live, 2),
    }
    out["attributed"] = round(out["termpool"] + out["containers"] + out["docker_shims"], 2)
    # How many runs this machine's memory holds: those live, and as many more as what is still
    # available holds at the larger of the two costs per run (MemAvailable's fall also has the
    # kernel's share, netns, veths, bridges, and everything else the machine's other users did).
    cost = max(out["attributed"], out["host_mem_available"])
    out["runs_memory_allows"] = live + int(snap["mem_available_mb"] / cost) if cost > 0 else None
    return out


# ---- part 4: latency at density -----------------------------------------------------------------
def latency(bench: Bench) -> dict:
    args = bench.args
    fleet, held = bench.fleet(), Recorder()

    def episodes(c: int, count: int) -> tuple[Recorder, float]:
        one = lambda f, i, rec: episode(f, rec, args.tool_calls, args.think)  # noqa: E731
        return run_phase(c, count, lambda i: fleet, one)

    try:
        bench.phase("latency")
        alone, _ = episodes(1, args.c1_episodes)
        fleet.grow(args.live - args.in_flight, held)
        repeats = []
        for r in range(args.repeats):
            bench.phase(f"latency-{r}")
            c1, c1_cpu = bench.window(f"c1-{r}", lambda: episodes(1, args.c1_episodes), False)
            loaded, cpu = bench.window(f"loaded-{r}", lambda: episodes(args.in_flight, 1), r == 0)
            repeats.append({"c1": c1, "loaded": loaded, "cpu": cpu, "live_held": len(fleet.leases)})
    finally:
        bench._end_phase("latency", fleet, held)
    for rec in [alone, *(r[side][0] for r in repeats for side in ("c1", "loaded"))]:
        bench.note("latency", rec)
    return summarize_latency(alone, repeats)


def summarize_latency(alone: Recorder, repeats: list[dict]) -> dict:
    ops = ("tool_call", "probe", "reset", "evaluate")

    def stat(rec: Recorder, op: str, q: float) -> float | None:
        return round(percentile(rec.samples[op], q), 1) if rec.samples.get(op) else None

    def median(side: str, op: str, q: float) -> float | None:
        values = [v for r in repeats if (v := stat(r[side][0], op, q)) is not None]
        return round(statistics.median(values), 1) if values else None

    def ratio(op: str, q: float) -> float | None:
        pairs = [(stat(r["loaded"][0], op, q), stat(r["c1"][0], op, 50)) for r in repeats]
        values = [a / b for a, b in pairs if a and b]
        return round(statistics.median(values), 2) if values else None

    table = {
        op: {
            "c1_alone": {"p50": stat(alone, op, 50), "p95": stat(alone, op, 95)},
            "c1": {"p50": median("c1", op, 50), "p95": median("c1", op, 95)},
            "loaded": {"p50": median("loaded", op, 50), "p95": median("loaded", op, 95)},
            "loaded_p50_over_c1_p50": ratio(op, 50),
            "loaded_p95_over_c1_p50": ratio(op, 95),
        }
        for op in ops
    }
    alone_p50 = stat(alone, "tool_call", 50)
    loaded_p50 = table["tool_call"]["loaded"]["p50"]
    return {
        "ops": table,
        "tool_call_loaded_over_c1_alone": round(loaded_p50 / alone_p50, 2) if alone_p50 and loaded_p50 else None,
        "episodes_wall_s": [round(r["loaded"][1], 1) for r in repeats],
        "live_held": [r["live_held"] for r in repeats],
        "cpu_loaded": [r["cpu"] for r in repeats],
    }


# ---- part 4: the start storm ----------------------------------------------------------------------
def storm(bench: Bench) -> dict:
    size, rounds = bench.args.storm, []
    floor = two_service_floor(bench)
    for r in range(bench.args.repeats):
        bench.phase(f"storm-{r}")
        floor_rec, floor_wall, floor_cpu = floor_storm(bench, floor, size, r)
        rec, wall, cpu = termpool_storm(bench, size, r)
        resets = rec.samples.get("reset") or [float("nan")]
        rounds.append(
            {
                "floor_s": round(floor_wall, 2),
                "termpool_s": round(wall, 2),
                "ratio": round(wall / floor_wall, 3),
                "floor_p50_ms": round(percentile(floor_rec.samples["create_start"], 50)),
                "reset_p50_ms": round(percentile(resets, 50)),
                "reset_p95_ms": round(percentile(resets, 95)),
                "started": len(rec.samples.get("reset", [])),
                "floor_started": len(floor_rec.samples.get("create_start", [])),
                "cpu_floor": floor_cpu,
                "cpu_termpool": cpu,
            }
        )
    return {"size": size, "ratio_median": statistics.median(r["ratio"] for r in rounds), "rounds": rounds}


def termpool_storm(bench: Bench, size: int, r: int) -> tuple:
    """`size` leases allocated (not timed), then all their resets released at once."""
    fleet, rec = bench.fleet(), Recorder()
    leases = [lease for lease in fleet.map(lambda _: fleet.allocate(rec), range(size)) if lease]

    def resets() -> tuple:
        return run_phase(len(leases), 1, lambda i: leases[i], lambda lease, i, _: fleet.reset_kept(lease, rec))

    try:
        (_, wall), cpu = bench.window(f"storm-{r}", resets, r == 0)
    finally:
        bench._end_phase(f"storm-{r}", fleet, rec)
    return rec, wall, cpu


def two_service_floor(bench: Bench) -> host.TwoServiceFloor:
    cfg = bench.cfg
    label = {host.FLOOR_LABEL: bench.stack.host_id}
    floor = Floor(
        bench.docker,
        compose_config.client_image(TASK, cfg),
        cfg.container_memory_limit,
        FIXTURES / TASK,
        bench.workdir,
        label,
    )
    # The upper half of the stack's own RUN_SUBNETS, in its blocks: termpool hands out the lowest
    # free blocks first, and has no run live while the floor's networks exist.
    blocks = cfg.run_subnets
    subnets = bench.args.floor_subnets or str(list(blocks.network.subnets(prefixlen_diff=1))[1])
    side = f"{name_prefix(TASK)}__side"
    return host.TwoServiceFloor(bench.docker, floor, side, bench.stack.host_id, subnets, blocks.prefix)


def floor_storm(bench: Bench, floor: host.TwoServiceFloor, size: int, r: int) -> tuple:
    def one(f, i, rec: Recorder) -> bool:
        began = time.perf_counter()
        try:
            f.start(bench.workdir)
        except Exception as exc:
            rec.error(f"floor: {type(exc).__name__}: {exc}")
            return False
        rec.add("create_start", (time.perf_counter() - began) * 1000)
        return True

    try:
        (rec, wall), cpu = bench.window(f"floor-{r}", lambda: run_phase(size, 1, lambda i: floor, one), False)
    finally:
        floor.remove_all()
    if rec.error_count:  # reported, but the floor's failures are Docker's, not termpool's
        bench.floor_failures.append(rec.error_messages)
    return rec, wall, cpu


# ---- the command ----------------------------------------------------------------------------------
def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default="density,latency,storm")
    p.add_argument("--levels", default="64,128,256", help="density: live runs at each step")
    p.add_argument("--live", type=int, default=128, help="latency: live runs, the in-flight episodes' included")
    p.add_argument("--in-flight", type=int, default=32, help="latency: episodes at once")
    p.add_argument("--tool-calls", type=int, default=10, help="latency: `echo hi` calls per episode")
    p.add_argument("--think", type=float, default=0.0, help="latency: seconds before each tool call")
    p.add_argument("--c1-episodes", type=int, default=3, help="latency: episodes one at a time per repeat")
    p.add_argument("--storm", type=int, default=128, help="storm: resets at once")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=20.0, help="density: CPU window with the runs idle")
    p.add_argument("--start-parallel", type=int, default=32, help="density: resets in flight while growing")
    p.add_argument(
        "--floor-subnets",
        default="",
        help="the storm floor's networks from this CIDR (default: RUN_SUBNETS' upper half)",
    )
    p.add_argument("--profile", action="store_true", help="py-spy on the facade and workers (loaded, storm)")
    args = parse_stack_args(p, argv)
    args.phase_list = [x.strip() for x in args.phases.split(",") if x.strip()]
    args.levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
    return args


def main(argv=None) -> int:
    args = parse(argv)
    subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], check=True, capture_output=True)
    date = time.strftime("%Y%m%d-%H%M", time.gmtime())
    result = {"date": date, "machine": f"{platform.node()}, 2 CPUs shared", "load_before": host.load_average()}
    bench = Bench(args)
    phases = {"density": density, "latency": latency, "storm": storm}
    try:
        bench.warm_up()
        for name in args.phase_list:
            result[name] = phases[name](bench)
            result[f"load_after_{name}"] = host.load_average()
    finally:
        bench.stop()
    result.update(left_behind=bench.left, failures=bench.failures, floor_failures=bench.floor_failures)
    result["closes"] = bench.closes
    result["peak"] = bench.monitor.peak("all")
    result["ok"] = not bench.left and not bench.failures
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit("bench.density", result, out / f"density-{date}.json")
    text = markdown({"command": "python -m bench.density " + " ".join(sys.argv[1:]), **result})
    (out / f"density-{date}.md").write_text(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
