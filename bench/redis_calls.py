"""Redis commands per tool call and per episode, from Redis's own command statistics.

    python -m bench.redis_calls [--calls 50] [--episodes 5] [--idle 10] [--env KEY=VALUE]

Starts a stack (devstack), measures the commands Redis processes while idle (heartbeats, queue
polls, beat), then over `--calls` tool calls on one lease and over `--episodes` whole episodes
(allocate, reset, 14 calls, evaluate, close). The idle rate over the same window is subtracted.
Prints one JSON line with the totals and the per-command breakdown (INFO commandstats), so a
change to the per-call path shows which commands it saved, and the episode's commands by
operation (each operation's own window; close's runs 3 s past the answer, so it holds the teardown
job, and reset's holds the warm pool's refill when the pool is on). Commands are Celery's and
termpool's together: both talk to the same Redis.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from devstack import Stack

TASK = "hello-file"
EPISODE_CALLS = 14
CLOSE_SETTLE = 3.0  # seconds after a close, so its teardown job falls in close's window (no polling: it would count)


def command_counts(stack: Stack) -> Counter:
    stats = stack.redis.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()})


def window(stack: Stack, work) -> tuple[Counter, float]:
    before = command_counts(stack)
    started = time.monotonic()
    work()
    seconds = time.monotonic() - started
    return command_counts(stack) - before, seconds


def net(counts: Counter, idle: Counter, idle_seconds: float, seconds: float, per: int) -> dict:
    scale = seconds / idle_seconds
    out = {name: round((n - idle.get(name, 0) * scale) / per, 2) for name, n in counts.items()}
    return dict(sorted(((k, v) for k, v in out.items() if abs(v) >= 0.05), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the stack, e.g. WARM_POOL_SIZE=0")
    args = parser.parse_args()
    stack = Stack(env=dict(item.split("=", 1) for item in args.env), beat=True).start()
    try:
        lease = stack.client.allocate(f"{TASK}#bench")
        lease.reset(TASK)
        for _ in range(3):  # connections and caches warm
            lease.exec("echo hi", timeout=60)
        idle, idle_seconds = window(stack, lambda: time.sleep(args.idle))

        def calls() -> None:
            for _ in range(args.calls):
                lease.exec("echo hi", timeout=60)

        call_counts, call_seconds = window(stack, calls)
        lease.close()

        by_op: Counter = Counter()
        op_seconds: Counter = Counter()

        def timed(op: str, work) -> None:
            counts, seconds = window(stack, work)
            by_op[op] += sum(counts.values()) - sum(idle.values()) * seconds / idle_seconds
            op_seconds[op] += seconds

        def episodes() -> None:
            for i in range(args.episodes):
                leases: list = []
                timed("allocate", lambda i=i, got=leases: got.append(stack.client.allocate(f"{TASK}#e{i}")))
                episode = leases[0]
                timed("reset", lambda ep=episode: ep.reset(TASK))
                timed("tool_calls", lambda ep=episode: [ep.exec("echo hi", timeout=60) for _ in range(EPISODE_CALLS)])
                timed("evaluate", lambda ep=episode: ep.evaluate())
                timed("close", lambda ep=episode: (ep.close(), time.sleep(CLOSE_SETTLE)))

        episode_counts, episode_seconds = window(stack, episodes)
    finally:
        stack.stop()
    per_call = net(call_counts, idle, idle_seconds, call_seconds, args.calls)
    per_episode = net(episode_counts, idle, idle_seconds, episode_seconds, args.episodes)
    print(
        json.dumps(
            {
                "idle_commands_per_s": round(sum(idle.values()) / idle_seconds, 1),
                "commands_per_tool_call": round(sum(per_call.values()), 1),
                "commands_per_episode": round(sum(per_episode.values()), 1),
                "tool_call_by_command": per_call,
                "episode_by_command": per_episode,
                "episode_by_operation": {op: round(n / args.episodes, 1) for op, n in by_op.items()},
                "idle_by_command": {k: round(v / idle_seconds, 2) for k, v in idle.most_common()},
            }
        )
    )


if __name__ == "__main__":
    main()
