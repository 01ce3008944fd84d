"""The facade's own operations against the reference pool server's figures (issue 38, item 5).

    python -m bench.facade [--calls 40] [--repeats 5] [--concurrency 1,8] [--no-profile] [--no-floor] [--out FILE]

A real stack (devstack: redis-server, one Celery worker per queue kind, gunicorn with
app/gunicorn_conf.py as deployed, the warm pool off), with a tenants file, every request
carrying a tenant's token, so the tenant check is on the measured path. At each concurrency
c, c threads (one keep-alive HTTP connection each) run each operation as a phase of its own,
`--calls` calls per thread: POST /allocate, /heartbeat and /close of the leases it made (the
calls that touch only the pool's records), then through POST /exec_tool on a lease reset
beforehand a non-blocking `shell_exec` (`block: false`) and the `shell_view` of each session.

A warm-up round of every phase is not counted. Figures are the medians over repeats of each
repeat's p50 / p95 (ms), beside the reference's p50 as the target, with the facade's CPU
(its gunicorn workers' user + system time) and Redis's commands (scripts' own included, the
idle rate subtracted) per request. With the profile on, py-spy samples the gunicorn workers
(`--gil`: CPU time in Python) over each part at c=1, for the share of the facade's CPU whose
leaf frame is termpool's own code (app/, termpool/), and that time as a share of the p50.
Then, unless --no-floor, the same calls on the bare stack termpool is built on
(bench/facade_floor.py): each operation's floor p50 and its own p50 as a multiple of it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench import facade_floor
from bench.density_host import left_behind, remove_left
from bench.density_runs import wait_closed
from bench.output import emit
from bench.profile import OWN_MODULES, consumers, read_stacks
from bench.stats import Recorder, median_of, median_value, summarize
from devstack import Stack
from environments.docker_client import docker_client

TASK = "hello-file"
WARMUP = 3
# The reference pool server's p50 (ms) as measured side by side in issue 38 (c=1, c=8).
REFERENCE = {
    "allocate": {1: 2.4, 8: 6.8},
    "close": {1: 2.2, 8: 4.1},
    "heartbeat": {1: 1.8},
    "view": {1: 3.2},
    "exec_nonblocking": {1: 10.6},
}
TENANTS = "tenants:\n  bench:\n    token: {token}\n    max_runs: 1000\n  other:\n    token: {other}\n    max_runs: 10\n"


class Caller:
    """One benchmark thread's keep-alive connection, with the tenant's token."""

    def __init__(self, url: str, token: str):
        self.http = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {token}"})

    def post(self, rec: Recorder | None, op: str, path: str, body: dict) -> dict:
        began = time.perf_counter()
        reply = self.http.post(path, json=body)
        if rec is not None:
            rec.add(op, (time.perf_counter() - began) * 1000)
        data = reply.json()
        if reply.status_code != 200 or not data.get("ok"):
            raise RuntimeError(f"{op}: {reply.status_code} {reply.text[:300]}")
        return data

    def tool(self, rec, op: str, lease: str, name: str, **arguments) -> str:
        body = {"lease_id": lease, "tool_call": {"name": name, "arguments": arguments}}
        return self.post(rec, op, "/exec_tool", body)["observation"]


OPS = ("allocate", "heartbeat", "close", "exec_nonblocking", "view")


class Thread:
    """One benchmark thread's caller, its reset lease, and what its last phase left for the next."""

    def __init__(self, caller: Caller, index: int, lease: str):
        self.caller, self.index, self.lease = caller, index, lease
        self.leases: list[str] = []  # allocated, to heartbeat and close
        self.sessions: list[str] = []  # started, to view

    def phase(self, op: str, calls: int, rec: Recorder | None) -> None:
        c = self.caller
        if op == "allocate":
            body = {"task_key": f"{TASK}#facade{self.index}"}
            self.leases = [c.post(rec, op, "/allocate", body)["lease_id"] for _ in range(calls)]
        elif op in ("heartbeat", "close"):
            for lease in self.leases:
                c.post(rec, op, f"/{op}", {"lease_id": lease})
        elif op == "exec_nonblocking":
            self.sessions = ["s" + uuid.uuid4().hex[:8] for _ in range(calls)]
            for sid in self.sessions:
                started = c.tool(rec, op, self.lease, "shell_exec", id=sid, command="true", block=False)
                if f"Session '{sid}' started" not in started:
                    raise RuntimeError(f"non-blocking exec: {started[:200]!r}")
        else:
            for sid in self.sessions:
                c.tool(rec, op, self.lease, "shell_view", id=sid)


def run_phase(threads: list[Thread], op: str, calls: int, rec: Recorder | None) -> None:
    """Every thread makes `calls` calls of the operation at once."""
    failures = []

    def work(thread: Thread) -> None:
        try:
            thread.phase(op, calls, rec)
        except Exception as exc:  # noqa: BLE001 (reported, and fails the run)
            failures.append(f"{op}: {exc}")

    running = [threading.Thread(target=work, args=(t,)) for t in threads]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    if failures:
        raise RuntimeError("; ".join(failures[:3]))


class Meter:
    """The facade's CPU (its gunicorn workers' user + system time) and Redis's commands (scripts'
    own included: INFO commandstats) over a phase, per request."""

    def __init__(self, stack: Stack):
        self.stack, self.pids = stack, web_workers(stack)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.idle_rate = 0.0  # Redis commands per second with no request (workers' polls, beats)

    def idle(self, seconds: float = 3.0) -> None:
        before = self.commands()
        time.sleep(seconds)
        self.idle_rate = (self.commands() - before - 1) / seconds

    def cpu(self) -> float:
        total = 0
        for pid in self.pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / self.tick

    def commands(self) -> int:
        return sum(v["calls"] for v in self.stack.redis.info("commandstats").values())

    def measure(self, fn, requests: int) -> dict:
        cpu, commands, began = self.cpu(), self.commands(), time.monotonic()
        fn()
        background = self.idle_rate * (time.monotonic() - began)
        return {
            "facade_cpu_ms": round((self.cpu() - cpu) * 1000 / requests, 3),
            "redis_commands": round((self.commands() - commands - 1 - background) / requests, 2),
        }


def web_workers(stack: Stack) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(stack.procs["web"].pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


PARTS = {"records": OPS[:3], "tools": OPS[3:]}


def profiled(stack: Stack, threads: list[Thread], part: str, seconds: int) -> dict:
    """The part's phases at c=1, over and over for `seconds`, with py-spy on the gunicorn workers."""
    rate, outs, spies = 250, [], []
    for pid in web_workers(stack):
        out = Path(tempfile.gettempdir()) / f"termpool-facade-{part}-{pid}.txt"
        outs.append(out)
        argv = ["py-spy", "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-r", str(rate), "--gil"]
        argv += ["-d", str(seconds), "--nonblocking"]
        spies.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    while any(spy.poll() is None for spy in spies):  # until every py-spy has written its file
        for op in PARTS[part]:
            run_phase(threads[:1], op, 10, None)
    stacks = [s for out in outs for s in read_stacks(out)]
    found = consumers(stacks, 12)
    total = found["samples"] or 1
    own = sum(n for frames, n in stacks if own_frame(frames[-1]))
    return {
        "own_code_share": round(own / total, 3),
        "by_package": {p: round(n / total, 3) for p, n in found["by_package"] if not p.startswith("termpool ")},
        "leaf": [(frame[:140], round(n / total, 3)) for frame, n in found["leaf"]],
        "own_inclusive": [(f[:140], round(n / total, 3)) for f, n in found["own_inclusive"] if own_frame(f)],
    }


def own_frame(frame: str) -> bool:
    """A py-spy frame ("function (path:line)") in termpool's own code (not celery/app/...)."""
    return any(f"({module}" in frame for module in OWN_MODULES)


def machine_load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(calls: int, repeats: int, levels: list[int], profile: bool, env: dict) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="termpool-facade-"))
    token, other = "tok-" + uuid.uuid4().hex, "tok-" + uuid.uuid4().hex
    (workdir / "tenants.yaml").write_text(TENANTS.format(token=token, other=other))
    stack_env = {"TENANTS_FILE": str(workdir / "tenants.yaml"), "POOL_API_TOKEN": "admin-" + uuid.uuid4().hex}
    stack_env |= {"WARM_POOL_SIZE": "0", "WORKER_MAX_RUNS_PER_TASK": str(max(64, calls + WARMUP))}
    stack = Stack(env={**stack_env, **env}, workdir=workdir).start()
    threads: list[Thread] = []
    try:
        for index in range(max(levels)):  # one reset run per thread, for the tool calls
            caller = Caller(stack.url, token)
            lease = caller.post(None, "allocate", "/allocate", {"task_key": f"{TASK}#tools{index}"})["lease_id"]
            meta = {"task_name": TASK, "task_path": TASK, "instruction": "bench"}
            caller.post(None, "reset", "/reset", {"lease_id": lease, "task_meta": meta})
            threads.append(Thread(caller, index, lease))
        meter = Meter(stack)
        meter.idle()
        result: dict = {"load_before": machine_load(), "redis_idle_per_s": round(meter.idle_rate, 1), "levels": {}}
        for c in levels:
            stats: dict[str, list] = {op: [] for op in OPS}
            costs: dict[str, list] = {op: [] for op in OPS}
            for op in OPS:  # warm-up, not counted
                run_phase(threads[:c], op, WARMUP, None)
            for _ in range(repeats):
                for op in OPS:
                    rec = Recorder()
                    costs[op].append(
                        meter.measure(functools.partial(run_phase, threads[:c], op, calls, rec), c * calls)
                    )
                    stats[op].append(summarize(rec.samples[op]))
            result["levels"][str(c)] = {op: target(median_of(stats[op]), costs[op], op, c) for op in OPS}
        result["load_after"] = machine_load()
        if profile:
            result["profile_c1"] = {part: profiled(stack, threads, part, 15) for part in PARTS}
            own_share(result)
        return result
    finally:
        close_and_stop(stack, threads, {"Authorization": f"Bearer {stack_env['POOL_API_TOKEN']}"})


def close_and_stop(stack: Stack, threads: list[Thread], admin: dict) -> None:
    """Close the tool calls' runs and wait for their teardowns, then stop the stack; anything
    of the stack still in Docker after that is named (stderr) and removed."""
    for thread in threads:
        with contextlib.suppress(Exception):  # the stack may be what failed
            thread.caller.post(None, "close", "/close", {"lease_id": thread.lease})
    with contextlib.suppress(Exception):
        wait_closed(stack, 120, admin)
    stack.stop()
    left = left_behind(docker_client(), stack.host_id)
    if any(left.values()):
        print(f"bench.facade: the stack left {left}; removed", file=sys.stderr)
        remove_left(docker_client(), left)


def own_share(result: dict) -> None:
    """Per operation at c=1: termpool's own code's CPU (its part's share of the facade's CPU, by
    py-spy) as a share of the request's p50."""
    for part, ops in PARTS.items():
        share = result["profile_c1"][part]["own_code_share"]
        for op in ops:
            figures = result["levels"].get("1", {}).get(op)
            if figures and figures["p50"]:
                figures["own_code_ms"] = round(share * figures["facade_cpu_ms"], 3)
                figures["own_code_share_of_p50"] = round(share * figures["facade_cpu_ms"] / figures["p50"], 3)


def target(stats: dict, costs: list[dict], op: str, c: int) -> dict:
    ref = REFERENCE.get(op, {}).get(c)
    stats = {k: v for k, v in stats.items() if k != "repeats"} | {"repeat_p50s": [s["p50"] for s in stats["repeats"]]}
    per_request = {k: median_value([cost[k] for cost in costs]) for k in costs[0]}
    return stats | per_request | {"reference_p50": ref, "met": None if ref is None else stats["p50"] <= ref}


def table(result: dict) -> str:
    lines = [
        "| c | operation | p50 | p95 | reference p50 | met | floor p50 | x floor | facade CPU ms | Redis commands "
        "| own code ms (of p50) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, ops in result["levels"].items():
        for op, s in ops.items():
            met = {True: "yes", False: "no", None: "-"}[s["met"]]
            own = f"{s['own_code_ms']} ({s['own_code_share_of_p50']:.0%})" if "own_code_ms" in s else "-"
            lines.append(
                f"| {c} | {op} | {s['p50']} | {s['p95']} | {s['reference_p50'] or '-'} | {met} "
                f"| {s.get('floor_p50', '-')} | {s.get('vs_floor', '-')} | {s['facade_cpu_ms']} | {s['redis_commands']} | {own} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="rounds per thread per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-floor", action="store_true", help="skip the bare stack's floor")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the stack, repeatable")
    parser.add_argument("--out")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    env = dict(kv.split("=", 1) for kv in args.env)
    result = measure(args.calls, args.repeats, levels, not args.no_profile, env)
    if not args.no_floor:
        result["floor"] = facade_floor.measure(args.calls, args.repeats, levels)
        facade_floor.beside(result["levels"], result["floor"])
    emit("bench.facade", result, args.out)
    print(table(result))


if __name__ == "__main__":
    main()
