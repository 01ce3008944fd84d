"""Two tenants on one host (issue 38, item 4): tenant B's evaluation beside tenant A's storm.

    python -m bench.storm [--storm-runs 128] [--storm-episodes 32] [--b-episodes 8]
                          [--b-tool-calls 10] [--think 1,2] [--b-nice 0] [--out bench/results]

One stack (devstack) with a TENANTS_FILE of two tenants: team-a (priority train) and team-b
(priority eval), the operator's POOL_API_TOKEN beside them; the warm pool off (every reset a
real start); the one-service fixture task hello-file (no network of its own: 128 runs fit
Docker's address pools), one task key. After a warm-up episode (the image is built there):

- alone: B runs --b-episodes episodes at once, the host otherwise quiet. A B episode: reset,
  --b-tool-calls `echo hi` calls each after a think time drawn from --think (seconds, an LLM
  turn), close.
- storm: A allocates --storm-runs runs, then releases their resets at once (held live until the
  phase ends) together with --storm-episodes closed-loop episodes (reset, --a-tool-calls calls
  with no think, close, again) that go on until B is done; --b-delay seconds into the storm, B
  runs the same episodes as alone.

Figures: B's tool call and reset p50 / p95 in each phase and storm over alone (targets: tool
call p50 within 1.5x, reset p50 within 2x). What B's calls waited on, from the job records in
Redis (queued_at, started_at, finished_at: poolcore/state/jobs.py) paired with the client's
times: outside the job (the facade, HTTP and the reply's way back), the queue (until a worker
took the job) and the job's run (the worker and Docker). Everything the stack started is
removed at the end (containers, networks, volumes by the stack's host label).

A trainer runs on a machine of its own; here B's client shares the pool host's 2 cores with
Docker, A's containers and A's client. --b-nice gives B's client process (not A's, not the
stack's) that nice value once the stack is up: -5, the facade's WEB_NICE, stands in for a
client whose cores are its own; 0 (the default) leaves it level with everything else. Exit status 1
when an operation of either tenant failed or anything was left behind; timings never change it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import density_host as host
from bench.density_runs import Fleet, wait_closed
from bench.episodes import ECHO_COMMAND, ECHO_OUTPUT
from bench.output import emit, parse_stack_args
from bench.stats import Recorder, summarize
from bench.storm_report import breakdown, report
from devstack import ROOT, Stack
from environments.docker_client import docker_client
from poolcore.state import Store

TASK = "hello-file"
ADMIN = "storm-admin-token"
STACK_KEYS = (
    "EXEC_CONCURRENCY",
    "LIFECYCLE_CONCURRENCY",
    "EVAL_CONCURRENCY",
    "TEARDOWN_CONCURRENCY",
    "WEB_CONCURRENCY",
)
TOKENS = {"team-a": "storm-team-a-token", "team-b": "storm-team-b-token"}


def tenants_yaml(args) -> str:
    """A (train) may hold its whole storm; B (eval) has its episodes' runs reserved."""
    a_runs = args.storm_runs + args.storm_episodes + 8
    return (
        "tenants:\n"
        f"  team-a:\n    token: {TOKENS['team-a']}\n    max_runs: {a_runs}\n    priority: train\n"
        f"  team-b:\n    token: {TOKENS['team-b']}\n    max_runs: {args.b_episodes + 4}\n"
        f"    reserved_runs: {args.b_episodes}\n    priority: eval\n"
    )


class Bench:
    """The stack, its Redis, and what every phase reports (failures, leftovers)."""

    def __init__(self, args):
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="tp-storm-"))
        (self.workdir / "tenants.yaml").write_text(tenants_yaml(args))
        top = args.storm_runs + args.storm_episodes + args.b_episodes
        env = {
            "POOL_API_TOKEN": ADMIN,
            "TENANTS_FILE": str(self.workdir / "tenants.yaml"),
            "WARM_POOL_SIZE": "0",
            "WORKER_MAX_TASKS": "2",
            "WORKER_MAX_RUNS_PER_TASK": str(top + 8),
            "WORKER_RUN_IDLE_TTL": "7200",
            "WORKER_ALLOCATED_TTL": "1800",  # the storm's leases wait for their resets
            "RESET_SESSION_TIMEOUT": "1800",
            **args.extra_env,
        }
        self.stack = Stack(env=env, beat=True).start()
        self.store = Store(self.stack.redis)
        self.docker = docker_client()
        self.admin = {"Authorization": f"Bearer {ADMIN}"}
        self.failures: dict[str, dict] = {}  # phase -> failed operations by "<op> <code>"
        self.left: dict[str, dict] = {}  # phase -> what it left behind

    def fleet(self, tenant: str, parallel: int) -> Fleet:
        return Fleet(self.stack.url, TASK, parallel=max(parallel, 1), token=TOKENS[tenant])

    def phase(self, name: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {name} (load {host.load_average()})", file=sys.stderr, flush=True)

    def end_phase(self, phase: str, fleets: list[Fleet], recs: list[Recorder]) -> None:
        """Close what is still live, wait for the teardowns, note failures and leftovers."""
        for fleet, rec in zip(fleets, recs):
            fleet.close_all(rec)
            fleet.stop()
        if not wait_closed(self.stack, 600 + 3 * self.args.storm_runs, self.admin):
            recs[0].error("teardowns still pending after the phase's closes")
        for fleet, rec in zip(fleets, recs):
            if fleet.codes or rec.error_count:
                found = self.failures.setdefault(phase, {"errors": 0, "codes": {}, "first": []})
                found["errors"] += rec.error_count
                found["codes"].update(fleet.codes)
                found["first"] = (found["first"] + rec.error_messages)[:5]
        self.check_left(phase)

    def check_left(self, phase: str) -> None:
        left = host.left_behind(self.docker, self.stack.host_id)
        if any(left.values()):
            self.left[phase] = left
            host.remove_left(self.docker, left)

    def stop(self) -> None:
        self.stack.stop()
        self.check_left("after stop")


# ---- tenant B: the evaluation ---------------------------------------------------------------------
def b_episode(bench: Bench, fleet: Fleet, rec: Recorder, seed: int) -> list[dict]:
    """One B episode; its jobs' records paired with the client's times (storm_report.breakdown)."""
    lo, hi = bench.args.think
    think = random.Random(seed)
    mine = Recorder()  # this episode's samples, in order, to pair with its jobs
    lease = fleet.start_one(mine)
    try:
        for _ in range(bench.args.b_tool_calls if lease else 0):
            time.sleep(think.uniform(lo, hi))
            if fleet.call(lease, ECHO_COMMAND, mine, "tool_call").strip() != ECHO_OUTPUT:
                mine.error(f"tool_call: not {ECHO_OUTPUT!r}")
                break
        jobs = bench.store.get_jobs(bench.store.run_jobs(lease)) if lease else []
    finally:
        if lease:
            fleet.close_one(lease, mine)
    for op, values in mine.samples.items():
        for ms in values:
            rec.add(op, ms)
    for message in mine.error_messages:
        rec.error(message)
    rec.episode_done(bool(lease) and not mine.error_count)
    return breakdown(jobs, mine.samples)


def b_phase(bench: Bench) -> tuple[Recorder, list[dict], Fleet]:
    """B's episodes, all at once; their samples and breakdowns."""
    n = bench.args.b_episodes
    fleet, rec = bench.fleet("team-b", n), Recorder()
    rows = fleet.map(lambda i: b_episode(bench, fleet, rec, i), range(n))
    return rec, [row for episode in rows for row in episode], fleet


# ---- tenant A: the storm ----------------------------------------------------------------------------
def a_loop(fleet: Fleet, rec: Recorder, calls: int, stop: threading.Event) -> int:
    """Closed-loop episodes (no think) until stop is set; how many ended."""
    done = 0
    while not stop.is_set():
        lease = fleet.start_one(rec)
        for _ in range(calls if lease else 0):
            if fleet.call(lease, ECHO_COMMAND, rec, "tool_call").strip() != ECHO_OUTPUT:
                break
        if lease:
            fleet.close_one(lease, rec)
            done += 1
        else:
            time.sleep(0.5)  # a refused start is counted; do not spin on it
    return done


class Storm:
    """A's storm in background threads: the held resets released at once, the closed loop."""

    def __init__(self, bench: Bench):
        args = bench.args
        self.args = args
        self.held, self.loop = bench.fleet("team-a", args.storm_runs), bench.fleet("team-a", args.storm_episodes)
        self.held_rec, self.loop_rec = Recorder(), Recorder()
        self.stop = threading.Event()
        self.leases = [
            x for x in self.held.map(lambda _: self.held.allocate(self.held_rec), range(args.storm_runs)) if x
        ]
        self.storm_s: float | None = None
        self.episodes: list[int] = []
        self.threads = [threading.Thread(target=self._resets), threading.Thread(target=self._loop)]

    def _resets(self) -> None:
        began = time.perf_counter()
        self.held.map(lambda lease: self.held.reset_kept(lease, self.held_rec), self.leases)
        self.storm_s = round(time.perf_counter() - began, 1)

    def _loop(self) -> None:
        calls, n = self.args.a_tool_calls, self.args.storm_episodes
        self.episodes = self.loop.map(lambda _: a_loop(self.loop, self.loop_rec, calls, self.stop), range(n))

    def start(self) -> Storm:
        for thread in self.threads:
            thread.start()
        return self

    def end(self) -> dict:
        """Stop the loop, wait for the held resets; A's own figures."""
        self.stop.set()
        for thread in self.threads:
            thread.join()
        return {
            "resets_at_once": len(self.leases),
            "resets_s_to_last": self.storm_s,
            "held_reset_ms": summarize(self.held_rec.samples.get("reset", [])),
            "loop_episodes": sum(self.episodes),
            "loop_reset_ms": summarize(self.loop_rec.samples.get("reset", [])),
            "loop_tool_call_ms": summarize(self.loop_rec.samples.get("tool_call", [])),
        }


def storm_process(bench: Bench, conn, b_done) -> None:
    """A's storm in a process of its own (forked), so that its 160 client threads do not share
    B's client's GIL: B's times are then the pool's, not the benchmark's. It sends "started",
    waits for B to end, closes its runs and sends back A's figures and failures."""
    os.setpriority(os.PRIO_PROCESS, 0, bench.args.a_nice)  # not B's --b-nice, which the fork copied
    storm = Storm(bench).start()
    conn.send("started")
    b_done.wait()
    a = storm.end()
    a["load_at_end"] = host.load_average()
    found = {"errors": 0, "codes": {}, "first": []}
    for fleet, rec in ((storm.held, storm.held_rec), (storm.loop, storm.loop_rec)):
        fleet.close_all(rec)
        fleet.stop()
        found["errors"] += rec.error_count
        found["codes"].update(fleet.codes)
        found["first"] = (found["first"] + rec.error_messages)[:5]
    conn.send((a, found))


def storm_phase(bench: Bench) -> tuple[Recorder, list[dict], dict]:
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    b_done = ctx.Event()
    storm = ctx.Process(target=storm_process, args=(bench, theirs, b_done), daemon=True)
    storm.start()
    if ours.recv() != "started":
        raise RuntimeError("the storm process did not start")
    time.sleep(bench.args.b_delay)  # A's resets are queued before B's first
    b = None
    try:
        bench.phase("storm: B beside A")
        b = b_phase(bench)
    finally:
        b_done.set()
        a, a_failures = ours.recv()
        storm.join(60)
        if a_failures["errors"] or a_failures["codes"]:
            bench.failures["storm"] = a_failures
        bench.end_phase("storm", [b[2]] if b else [], [b[0]] if b else [])
    return b[0], b[1], a


# ---- the command ---------------------------------------------------------------------------------------
def count(text: str) -> int:
    """A size: a whole number of at least 1 (argparse refuses anything else with exit 2)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def think_range(text: str) -> tuple[float, float]:
    """lo,hi seconds, 0 <= lo <= hi."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not lo,hi seconds") from None
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want 0 <= lo <= hi")
    return lo, hi


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storm-runs", type=count, default=128, help="A: resets released at once, held live")
    p.add_argument("--storm-episodes", type=count, default=32, help="A: closed-loop episodes in flight")
    p.add_argument("--a-tool-calls", type=count, default=10, help="A: `echo hi` calls per closed-loop episode")
    p.add_argument("--b-episodes", type=count, default=8, help="B: episodes at once, in each phase")
    p.add_argument("--b-tool-calls", type=count, default=10, help="B: `echo hi` calls per episode")
    p.add_argument(
        "--think", type=think_range, default="1,2", help="B: think time before each call, seconds lo,hi (uniform)"
    )
    p.add_argument("--b-delay", type=float, default=1.0, help="seconds into A's storm before B starts")
    p.add_argument("--b-nice", type=int, default=0, choices=range(-20, 20), metavar="-20..19", help="B's client's nice")
    args = parse_stack_args(p, argv)
    args.a_nice = os.getpriority(os.PRIO_PROCESS, 0)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], check=True, capture_output=True)
    date = time.strftime("%Y%m%d-%H%M", time.gmtime())
    result = {"date": date, "machine": f"{platform.node()}, {os.cpu_count()} CPUs shared"}
    result["load_before"] = host.load_average()
    bench = Bench(args)
    result["b_nice"] = args.b_nice
    os.setpriority(os.PRIO_PROCESS, 0, args.b_nice)  # this thread and the threads it starts: B's client
    try:
        bench.phase("warm-up")
        warm = bench.fleet("team-b", 1)
        warm_rec = Recorder()
        warm.map(lambda i: b_episode(bench, warm, warm_rec, i), [0])
        bench.end_phase("warm-up", [warm], [warm_rec])
        bench.phase("alone: B")
        alone, alone_rows, fleet = b_phase(bench)
        result["load_after_alone"] = host.load_average()
        bench.end_phase("alone", [fleet], [alone])
        bench.phase("storm: A allocates")
        storm, storm_rows, a = storm_phase(bench)
        result["load_after_storm"] = host.load_average()
    finally:
        bench.stop()
    result["stack"] = {k: bench.stack.env.get(k) for k in STACK_KEYS}
    result.update(report(args, alone, alone_rows, storm, storm_rows, a))
    result.update(failures=bench.failures, left_behind=bench.left)
    result["ok"] = not bench.failures and not bench.left
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit("bench.storm", result, out / f"storm-{date}.json")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
