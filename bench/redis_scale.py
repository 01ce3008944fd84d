"""The scale model, measured: how many tool calls one Redis core carries.

    python -m bench.redis_scale [--rates 250,500,1000,2000,4000] [--seconds 10] [--procs 2]

Starts a private redis-server as the deployments run it (append-only file, fsync every
second; pinned to CPU 0 where the machine has more than one), then replays a tool call's
Redis work at rising rates: the facade's and the worker's calls through termpool's own Store
(the same Lua scripts and pipelines) and Celery's broker commands for one message (LPUSH of a
message of a real task's size, then BRPOP; no ack, as kombu's ack emulation is off). `--procs` load
processes (pinned to the other CPUs) pace the calls open-loop. Per rate: the calls done,
Redis's commands per call and per second (INFO commandstats), the share of one core Redis
used (INFO cpu, its own user + system time) and the call's latency.

The figure that matters is Redis's CPU per call: while Redis has headroom it is flat, and one
core carries 1 / (CPU per call) calls per second. Where the load processes cannot push Redis
to saturation (2 cores: they are the bottleneck), that quotient is the estimate, marked
"extrapolated"; a machine with more cores runs the same command to see the plateau.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid

import redis

from devstack import free_port
from poolcore.state import Store, keys

CELERY_MESSAGE_BYTES = 1400  # a pool.tool_call message with its headers, as kombu stores it
QUEUE = "termpool.bench.exec"


def start_redis(workdir: str, port: int) -> subprocess.Popen:
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir]
    argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
    if (os.cpu_count() or 1) > 1 and shutil.which("taskset"):
        argv = ["taskset", "-c", "0", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def seed_run(store: Store, raw: redis.Redis, run_id: str) -> None:
    """A ready run on host "bench", as a reset leaves it."""
    store.update_run(run_id, state="ready", host="bench", task_key="bench", env={"client": "c"})
    raw.zadd(keys.host_live_key("bench"), {run_id: time.time()})


def tool_call(store: Store, raw: redis.Redis, run_id: str, token: str, message: bytes) -> None:
    """One tool call's Redis work, in the order the facade and the worker do it."""
    job_id = str(uuid.uuid4())
    store.use_run(run_id, call_job=job_id)  # facade: the lease, marked as used (busy with this call)
    store.create_job(job_id, run_id, "tool_call", call={"name": "shell_exec", "arguments": {"cmd": "echo hi"}})
    raw.lpush(QUEUE, message)  # Celery: publish
    raw.brpop([QUEUE], timeout=1)  # the worker's consumer takes it (no ack emulation: nothing more)
    store.begin_job(job_id, "exec@bench", token)  # the worker has the run's env from the message
    store.job_finished(job_id, result="hi\n", worker=token)
    store.wait_job(job_id, timeout=5)  # facade: the wake-up and the record


def load(port: int, rate: float, seconds: float, cpu: int | None, out) -> None:
    """One load process: `rate` calls/s, open loop, for `seconds`; its latencies to `out`."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    raw = redis.Redis(port=port)
    store = Store(redis.Redis(port=port, decode_responses=True))
    run_id, token = "run-" + uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
    seed_run(store, raw, run_id)
    message = b"x" * CELERY_MESSAGE_BYTES
    latencies, start = [], time.perf_counter()
    for i in range(int(rate * seconds)):
        due = start + i / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        t0 = time.perf_counter()
        tool_call(store, raw, run_id, token, message)
        latencies.append(time.perf_counter() - t0)
    out.put({"calls": len(latencies), "wall": time.perf_counter() - start, "latencies": latencies})


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commands(client: redis.Redis) -> int:
    return sum(v["calls"] for v in client.info("commandstats").values())


def idle_cpu_per_s(port: int, seconds: float = 3.0) -> float:
    """Redis's own CPU per second doing nothing (its timers, the AOF's fsync): subtracted, so a
    low rate does not charge it to the few calls it served."""
    client = redis.Redis(port=port)
    cpu0, t0 = redis_cpu(client), time.perf_counter()
    time.sleep(seconds)
    return (redis_cpu(client) - cpu0) / (time.perf_counter() - t0)


def step(port: int, rate: float, seconds: float, procs: int, idle: float) -> dict:
    client = redis.Redis(port=port)
    cpus = sorted(os.sched_getaffinity(0))
    load_cpus = [c for c in cpus if c != 0] or [None]
    queue = multiprocessing.Queue()
    workers = [
        multiprocessing.Process(target=load, args=(port, rate / procs, seconds, load_cpus[i % len(load_cpus)], queue))
        for i in range(procs)
    ]
    cpu0, cmd0, t0 = redis_cpu(client), commands(client), time.perf_counter()
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - t0
    cpu, cmds = redis_cpu(client) - cpu0 - idle * wall, commands(client) - cmd0 - 2  # the two INFO calls
    calls = sum(r["calls"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies"])
    achieved = calls / max(r["wall"] for r in results)
    return {
        "target_calls_per_s": rate,
        "calls_per_s": round(achieved, 1),
        "kept_up": achieved >= 0.95 * rate,
        "commands_per_call": round(cmds / calls, 1),
        "commands_per_s": round(cmds / wall),
        "redis_core_share": round(cpu / wall, 3),
        "redis_cpu_us_per_call": round(cpu / calls * 1e6, 1),
        "latency_ms_p50": round(statistics.median(latencies) * 1000, 2),
        "latency_ms_p99": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="250,500,1000,2000,4000")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=2)
    args = parser.parse_args()
    workdir, port = tempfile.mkdtemp(prefix="termpool-scale-"), free_port()
    proc = start_redis(workdir, port)
    steps = []
    try:
        idle = idle_cpu_per_s(port)
        for rate in (float(r) for r in args.rates.split(",")):
            steps.append(step(port, rate, args.seconds, args.procs, idle))
            print(json.dumps(steps[-1]), flush=True)
            if not steps[-1]["kept_up"]:
                break  # the load processes (or Redis) are at their limit: higher rates say nothing more
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    best = max(steps, key=lambda s: s["calls_per_s"])
    cpu_per_call = statistics.median(s["redis_cpu_us_per_call"] for s in steps) / 1e6
    saturated = best["redis_core_share"] >= 0.9
    capacity = best["calls_per_s"] if saturated else 1 / cpu_per_call
    summary = {
        "redis_cpu_us_per_call": round(cpu_per_call * 1e6, 1),
        "redis_idle_core_share": round(idle, 4),
        "calls_per_s_one_core": round(capacity),
        "how": "measured at saturation" if saturated else "extrapolated: 1 / Redis CPU per call",
        "runs_at_one_call_per_5s": round(capacity * 5),
        "steps": steps,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
