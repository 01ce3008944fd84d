"""The facade's own operations against the reference pool server's figures (issue 38, item 5).

    python -m bench.facade [--calls 40] [--repeats 5] [--concurrency 1,8] [--no-profile] [--out FILE]

A real stack (devstack: redis-server, one Celery worker per queue kind, gunicorn with
app/gunicorn_conf.py as deployed), with a tenants file, every request carrying a tenant's
token, so the tenant check is on the measured path. At each concurrency c, c threads (one
keep-alive HTTP connection each) run, per repeat:

- **records**: `--calls` rounds of POST /allocate, /heartbeat, /close on a task key of their
  own (the calls that touch only the pool's records);
- **tools**: `--calls` rounds of a non-blocking `shell_exec` (`block: false`) and the
  `shell_view` of its session, through POST /exec_tool on a lease reset once beforehand.

Each thread's first `WARMUP` rounds of a repeat are not counted. Figures are the medians over
repeats of each repeat's p50 / p95 (ms), beside the reference's p50 as the target. With the
profile on, py-spy samples the gunicorn workers (`--gil`: CPU time in Python) during one more
repeat of each part at c=1; the result gives CPU ms per request and the share of it whose
leaf frame is termpool's own code (app/, termpool/), by package otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.output import emit
from bench.profile import OWN_MODULES, consumers, read_stacks
from bench.stats import Recorder, median_of, summarize
from devstack import Stack

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


def records_round(caller: Caller, rec, index: int) -> None:
    lease = caller.post(rec, "allocate", "/allocate", {"task_key": f"{TASK}#facade{index}"})["lease_id"]
    caller.post(rec, "heartbeat", "/heartbeat", {"lease_id": lease})
    caller.post(rec, "close", "/close", {"lease_id": lease})


def tools_round(caller: Caller, rec, lease: str) -> None:
    sid = "s" + uuid.uuid4().hex[:8]
    started = caller.tool(rec, "exec_nonblocking", lease, "shell_exec", id=sid, command="true", block=False)
    if f"Session '{sid}' started" not in started:
        raise RuntimeError(f"non-blocking exec: {started[:200]!r}")
    caller.tool(rec, "view", lease, "shell_view", id=sid)


def run_part(callers: list[Caller], leases: list[str], part: str, calls: int) -> Recorder:
    """Every thread runs `calls` rounds of the part (its first WARMUP not recorded)."""
    rec, failures = Recorder(), []

    def worker(index: int) -> None:
        try:
            for n in range(WARMUP + calls):
                measured = rec if n >= WARMUP else None
                if part == "records":
                    records_round(callers[index], measured, index)
                else:
                    tools_round(callers[index], measured, leases[index])
        except Exception as exc:  # noqa: BLE001 (reported, and fails the run)
            failures.append(f"{part}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(callers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError("; ".join(failures[:3]))
    return rec


def web_workers(stack: Stack) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(stack.procs["web"].pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def profiled(stack: Stack, callers, leases, part: str, seconds: int) -> dict:
    """The part at c=1 over `seconds` with py-spy on the gunicorn workers."""
    rate, outs, spies = 250, [], []
    for pid in web_workers(stack):
        out = Path(tempfile.gettempdir()) / f"termpool-facade-{part}-{pid}.txt"
        outs.append(out)
        argv = ["py-spy", "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-r", str(rate), "--gil"]
        argv += ["-d", str(seconds), "--nonblocking"]
        spies.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    rec = Recorder()
    while any(spy.poll() is None for spy in spies):  # rounds until every py-spy has written its file
        for op, values in run_part(callers[:1], leases, part, 5).samples.items():
            rec.samples[op] += values
    for spy in spies:
        spy.wait()
    stacks = [s for out in outs for s in read_stacks(out)]
    found = consumers(stacks, 12)
    rounds = len(rec.samples["view" if part == "tools" else "close"]) * (WARMUP + 5) / 5
    requests = rounds * (3 if part == "records" else 2)
    total = found["samples"] or 1
    own = sum(n for frames, n in stacks if own_frame(frames[-1]))
    return {
        "requests": requests,
        "cpu_ms_per_request": round(found["samples"] * 1000 / rate / requests, 2),
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
    stack = Stack(env={"WARM_POOL_SIZE": "0", **stack_env, **env}, workdir=workdir).start()
    try:
        callers = [Caller(stack.url, token) for _ in range(max(levels))]
        leases = []
        for index, caller in enumerate(callers):  # one reset run per thread, for the tool calls
            lease = caller.post(None, "allocate", "/allocate", {"task_key": f"{TASK}#tools{index}"})["lease_id"]
            caller.post(
                None, "reset", "/reset", {"lease_id": lease, "task_meta": {"task_name": TASK, "task_path": TASK}}
            )
            leases.append(lease)
        result: dict = {"load_before": machine_load(), "levels": {}}
        for c in levels:
            per_op: dict[str, list] = {}
            for _ in range(repeats):
                for part in ("records", "tools"):
                    rec = run_part(callers[:c], leases, part, calls)
                    for op, values in rec.samples.items():
                        per_op.setdefault(op, []).append(summarize(values))
            result["levels"][str(c)] = {op: target(median_of(s), op, c) for op, s in per_op.items()}
        result["load_after"] = machine_load()
        if profile:
            result["profile_c1"] = {part: profiled(stack, callers, leases, part, 15) for part in ("records", "tools")}
        return result
    finally:
        stack.stop()


def target(stats: dict, op: str, c: int) -> dict:
    ref = REFERENCE.get(op, {}).get(c)
    stats = {k: v for k, v in stats.items() if k != "repeats"} | {"repeat_p50s": [s["p50"] for s in stats["repeats"]]}
    return stats | {"reference_p50": ref, "met": None if ref is None else stats["p50"] <= ref}


def table(result: dict) -> str:
    lines = ["| c | operation | p50 | p95 | reference p50 | met |", "|---|---|---|---|---|---|"]
    for c, ops in result["levels"].items():
        for op, s in ops.items():
            met = {True: "yes", False: "no", None: "-"}[s["met"]]
            lines.append(f"| {c} | {op} | {s['p50']} | {s['p95']} | {s['reference_p50'] or '-'} | {met} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="rounds per thread per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the stack, repeatable")
    parser.add_argument("--out")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    env = dict(kv.split("=", 1) for kv in args.env)
    result = measure(args.calls, args.repeats, levels, not args.no_profile, env)
    emit("bench.facade", result, args.out)
    print(table(result))


if __name__ == "__main__":
    main()
