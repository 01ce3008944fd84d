"""Benchmark one pool over one or two worker hosts on this machine (the second on a second
dockerd, tests/second_docker.py): pool API episodes at a fixed concurrency, with placement
balance, errors, Redis commands per episode and episodes/s.

    python -m bench.hosts --hosts 2 [--concurrency 32] [--episodes 96] [--tool-calls 10] [--out FILE]

Episodes are bench/episodes.py's pool episodes (hello-file: start, N x `echo hi`, write the
answer, evaluate, close), spread over RUNS_PER_KEY runs per task key so WORKER_MAX_RUNS_PER_TASK
does not cap them. Both hosts run on this machine's cores: two hosts share the same CPUs, so
they do not double the rate here; the figure shows what placement and Redis cost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import docker

from bench.episodes import TASK, BenchClient, pool_episode
from bench.stats import Recorder
from devstack import Stack
from devstack.second_docker import SecondDocker
from poolcore.state import Store

RUNS_PER_KEY = 8
IDLE_SECONDS = 10.0
BASE_IMAGE = "termpool-test-base:bookworm"


def log(message: str) -> None:
    print(f"[bench.hosts {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, choices=(1, 2), default=2, help="worker hosts (2: a second dockerd)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--episodes", type=int, default=96, help="episodes measured (after one warm-up per host)")
    p.add_argument("--tool-calls", type=int, default=10)
    p.add_argument("--out", help="write the result as JSON here too")
    return p.parse_args(argv)


def warm_up(stack: Stack, store: Store, hosts: list[str]) -> None:
    """One episode per host (the others drained), so every host has the task's image built."""
    for host in hosts:
        others = [h for h in hosts if h != host]
        for other in others:
            store.set_draining(other, True)
        try:
            client, rec = BenchClient(stack.url), Recorder()
            if not pool_episode(client, rec, TASK, 1):
                raise RuntimeError(f"warm-up episode on {host} failed: {rec.error_messages}")
        finally:
            for other in others:
                store.set_draining(other, False)


def measure(stack: Stack, store: Store, args) -> dict:
    rec = Recorder()
    keys = [f"{TASK}-{uuid.uuid4().hex[:6]}" for _ in range(-(-args.concurrency // RUNS_PER_KEY))]
    idle_before = stack.redis.info("stats")["total_commands_processed"]
    time.sleep(IDLE_SECONDS)  # what the pool costs Redis doing nothing (heartbeats, queue polls)
    commands_before = stack.redis.info("stats")["total_commands_processed"]
    memory_before = stack.redis.info("memory")["used_memory"]
    idle_rate = (commands_before - idle_before) / IDLE_SECONDS

    counter = itertools.count()
    results: list[bool] = []

    def worker(slot: int) -> None:
        """One of `concurrency` clients; each keeps to one task key, so no key ever has more
        than RUNS_PER_KEY episodes in flight."""
        client = BenchClient(stack.url)
        try:
            while next(counter) < args.episodes:
                ok = pool_episode(client, rec, keys[slot % len(keys)], args.tool_calls)
                rec.episode_done(ok)
                results.append(ok)
        finally:
            client.close()

    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(worker, range(args.concurrency)))
    seconds = time.monotonic() - started
    commands = stack.redis.info("stats")["total_commands_processed"] - commands_before
    kept = stack.redis.info("memory")["used_memory"] - memory_before  # closed runs' records stay 24 h
    clients = stack.redis.info("clients")["connected_clients"]
    placed = Counter(store.get_run(run)["host"] for run in rec.run_ids)
    return {
        "hosts": args.hosts,
        "concurrency": args.concurrency,
        "episodes": args.episodes,
        "tool_calls_per_episode": args.tool_calls,
        "succeeded": sum(results),
        "errors": rec.error_count,
        "first_errors": rec.error_messages,
        "seconds": round(seconds, 1),
        "episodes_per_s": round(args.episodes / seconds, 3),
        "placement": dict(placed),
        "redis_commands_per_episode": round(commands / args.episodes, 1),
        "redis_idle_commands_per_s": round(idle_rate, 1),
        "redis_commands_per_episode_net": round((commands - idle_rate * seconds) / args.episodes, 1),
        "redis_bytes_kept_per_episode": round(kept / args.episodes),
        "redis_connections": clients,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # Capacity for the whole concurrency on each host (one host takes it all at --hosts 1).
    env = {"WORKER_MAX_TASKS": "16", "WORKER_MAX_RUNS_PER_TASK": str(RUNS_PER_KEY), "EXEC_CONCURRENCY": "32"}
    stack = Stack(env=env)
    second = SecondDocker() if args.hosts == 2 else None
    hosts = [stack.host_id]
    try:
        stack.start()
        if second:
            log("starting a second dockerd")
            second.start()
            second.load_image(BASE_IMAGE)
            hosts.append("b" + uuid.uuid4().hex[:8])
            stack.start_host(hosts[1], second.host_env())
        store = Store.from_url(stack.env["REDIS_URL"])
        log(f"warming up {hosts}")
        warm_up(stack, store, hosts)
        log(f"{args.episodes} episodes at {args.concurrency} at once over {len(hosts)} host(s)")
        result = measure(stack, store, args)
    finally:
        stack.stop()
        daemons = [(docker.from_env(), stack.host_id)] + [(second.client(), h) for h in hosts[1:] if second]
        for client, host in daemons:  # nothing should be left; whatever is, goes
            for container in client.containers.list(all=True, filters={"label": f"termpool.host={host}"}):
                container.remove(force=True)
        if second:
            second.stop()
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)
    return 0 if result["succeeded"] == args.episodes else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
