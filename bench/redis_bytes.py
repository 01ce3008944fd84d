"""The Redis memory one episode leaves behind for RECORD_TTL (docs/operations.md, "Sizing").

    python -m bench.redis_bytes [--episodes 20] [--tool-calls 12] [--task hello-file]

Starts a private stack (devstack, the test fixtures as dataset, the real dockerd), runs the
episodes one after another through the pool API (allocate, reset, the tool calls, evaluate,
close), waits for every teardown, then reports two figures:

* per episode, MEMORY USAGE summed over the keys an episode leaves (its run record and job
  list, its jobs and their done lists), the mean over the episodes;
* INFO used_memory after the episodes minus before them, per episode (everything: Redis' own
  overhead per key, the run viewer's index, counters), the figure to size Redis with.

It prints one JSON object; --out also writes it to a file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.output import emit
from devstack import Stack
from poolcore.state import Store, job_done_key, job_key, run_jobs_key, run_key

DAY = 24 * 3600


def episode(pool, task: str, tool_calls: int) -> str:
    lease = pool.allocate(task)
    lease.reset(task)
    for i in range(tool_calls):
        lease.exec(f"echo step {i} && ls /", id="main")
    lease.evaluate()
    lease.close()
    return lease.id


def episode_keys(store: Store, run_id: str) -> list[str]:
    jobs = store.run_jobs(run_id)
    return [run_key(run_id), run_jobs_key(run_id), *(k for j in jobs for k in (job_key(j), job_done_key(j)))]


def measure(stack: Stack, episodes: int, tool_calls: int, task: str) -> dict:
    store = Store(stack.redis)
    pool = stack.client
    episode(pool, task, tool_calls)  # the first builds the image and fills Redis' fixed keys
    wait_closed(store, stack.host_id)
    before = stack.redis.info("memory")["used_memory"]
    runs = [episode(pool, task, tool_calls) for _ in range(episodes)]
    wait_closed(store, stack.host_id)
    after = stack.redis.info("memory")["used_memory"]
    per_run = []
    for run_id in runs:
        names = episode_keys(store, run_id)
        per_run.append({"keys": len(names), "bytes": sum(stack.redis.memory_usage(k) or 0 for k in names)})
    by_keys = sum(r["bytes"] for r in per_run) / len(per_run)
    by_info = (after - before) / episodes
    return {
        "episodes": episodes,
        "tool_calls_per_episode": tool_calls,
        "jobs_per_episode": per_run[0]["keys"] // 2 - 1,
        "keys_per_episode": per_run[0]["keys"],
        "memory_usage_bytes_per_episode": round(by_keys),
        "used_memory_delta_bytes_per_episode": round(by_info),
        "day_at_1_episode_per_s_gib": round(max(by_keys, by_info) * DAY / (1 << 30), 2),
    }


def wait_closed(store: Store, host: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while store.closing_runs(host) and time.monotonic() < deadline:
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--tool-calls", type=int, default=12)
    parser.add_argument("--task", default="hello-file")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    stack = Stack(env={"WARM_POOL_SIZE": "0"}).start()
    try:
        result = measure(stack, args.episodes, args.tool_calls, args.task)
    finally:
        stack.stop()
    emit("bench.redis_bytes", result, args.out)


if __name__ == "__main__":
    main()
