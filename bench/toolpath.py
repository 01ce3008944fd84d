"""A c=1 tool call against its parts, interleaved in one run (issue 23, target 2).

    python -m bench.toolpath [--calls 100] [--repeats 5] [--warm-pool 0] [--flower] [--out FILE]

Three things, each measured as `--calls` back-to-back `echo hi` calls per repeat, the three
taking turns in every repeat (so a change in the machine's load falls on all of them):

- **termpool**: shell_exec through the pool API (a reset lease of the `hello-file` fixture
  task, a stack from devstack with the warm pool as `--warm-pool` sets it);
- **helper alone**: the same shell_exec through termpool's own tool code in this process
  (environments.tools.run_tool on the run's container, through its server's socket, as the
  exec worker calls it): what the call costs with no HTTP, Redis or Celery around it;
- **stack floor's job call**: POST /job on bench/minimal_stack.py (Flask + gunicorn + Celery +
  Redis doing nothing else), on a Redis of its own, so neither Flower sees the other's events.

The target: termpool's p50 at most the floor's job call p50 + the helper's p50 + 3 ms (the
medians over repeats of each repeat's p50). Prints one JSON document (also to `--out`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from bench import stack_floor
from bench.episodes import ECHO_COMMAND, ECHO_OUTPUT
from bench.output import emit
from bench.run import start_flower
from bench.stats import percentile
from devstack import Stack
from environments.docker_client import KnownContainer, docker_client
from environments.lifecycle import ctl_socket
from environments.tools import run_tool
from poolcore.state import Store
from termpool.client.calls import exec_call

TASK = "hello-file"
MARGIN_MS = 3.0


class _NoSessions:
    """A blocking shell_exec keeps no session record."""

    def get(self, sid: str) -> dict:
        return {}

    def set(self, sid: str, **fields) -> None:
        pass


def _timed(calls: int, one) -> list[float]:
    samples = []
    for _ in range(calls):
        began = time.perf_counter()
        one()
        samples.append((time.perf_counter() - began) * 1000)
    return samples


def _check(output: str, what: str) -> None:
    if ECHO_OUTPUT not in output:
        raise RuntimeError(f"{what}: unexpected output {output[:200]!r}")


def measure(calls: int, repeats: int, warm_pool: int, flower: bool) -> dict:
    pool = Stack(env={"WARM_POOL_SIZE": str(warm_pool)}, beat=True).start()
    floor = Stack()
    try:
        if flower:
            start_flower(pool)
        floor.start_redis()
        stack_floor.start(floor, 1, flower)
        lease = pool.client.allocate(f"{TASK}#toolpath")
        lease.reset(TASK)
        env = Store(pool.redis).get_run(lease.id)["env"]
        container = KnownContainer(docker_client(), env["client"], env.get("user", ""))
        call = exec_call(ECHO_COMMAND, id="bench", timeout=60)
        socket = ctl_socket(env) or None

        def through_termpool() -> None:
            _check(lease.exec(ECHO_COMMAND, id="bench", timeout=60), "termpool")

        def helper_alone() -> None:
            _check(run_tool(container, call["name"], call["arguments"], _NoSessions(), ctl_socket=socket), "helper")

        with httpx.Client(base_url=floor.url, timeout=10) as http:

            def floor_job() -> None:
                http.post("/job", json={"id": "toolpath"}).raise_for_status()

            parts = {"termpool": through_termpool, "helper": helper_alone, "floor_job": floor_job}
            for one in parts.values():  # connections and caches warm
                _timed(20, one)
            runs = [{name: _timed(calls, one) for name, one in parts.items()} for _ in range(repeats)]
        lease.close()
    finally:
        floor.stop()
        pool.stop()
    return summarize(runs, calls, warm_pool, flower)


def summarize(runs: list[dict], calls: int, warm_pool: int, flower: bool) -> dict:
    p50 = {name: round(statistics.median(percentile(r[name], 50) for r in runs), 2) for name in runs[0]}
    p95 = {name: round(statistics.median(percentile(r[name], 95) for r in runs), 2) for name in runs[0]}
    limit = round(p50["floor_job"] + p50["helper"] + MARGIN_MS, 2)
    return {
        "calls_per_repeat": calls,
        "repeats": len(runs),
        "warm_pool_size": warm_pool,
        "flower": flower,
        "p50_ms": p50,
        "p95_ms": p95,
        "per_repeat_p50_ms": [{name: round(percentile(r[name], 50), 2) for name in r} for r in runs],
        "target": {"limit_ms": limit, "value_ms": p50["termpool"], "met": p50["termpool"] <= limit},
        "termpool_over_parts_ms": round(p50["termpool"] - p50["floor_job"] - p50["helper"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warm-pool", type=int, default=0, help="WARM_POOL_SIZE of termpool's stack")
    p.add_argument("--flower", action="store_true", help="Flower on both stacks (their events on)")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args()
    emit("bench.toolpath", measure(args.calls, args.repeats, args.warm_pool, args.flower), args.out)


if __name__ == "__main__":
    main()
