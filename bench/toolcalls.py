"""CPU per tool call of termpool's processes: `echo hi` through the pool API, c leases at once,
with the CPU accounting of bench/monitor.py over the calls alone (no start, no teardown).

    python -m bench.toolcalls [--calls 300] [--concurrency 4] [--flower]

Prints one JSON line: the calls, their wall time, and CPU milliseconds per call by process
group (bench/report.py's groups). A quick A/B instrument for the per-call path (facade, exec
worker, Redis); the figures grow with the machine's load, so compare interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from bench.monitor import Monitor
from bench.report import cpu_per_episode
from bench.run import start_flower
from devstack import Stack

SHOWN = ("termpool", "facade", "exec", "flower", "redis", "dockerd", "containerd", "bench", "machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--flower", action="store_true", help="run Flower against the stack")
    args = parser.parse_args()
    stack = Stack(beat=False).start()
    monitor = None
    try:
        if args.flower:
            start_flower(stack)
        leases = [stack.client.allocate(f"hello-file#{i // 8}") for i in range(args.concurrency)]
        for lease in leases:
            lease.reset("hello-file")
            for _ in range(5):  # connections and caches warm
                lease.exec("echo hi", timeout=60)
        monitor = Monitor(stack.procs, stack.url).start()
        time.sleep(1)
        per_lease = args.calls // args.concurrency

        def calls(lease) -> None:
            for _ in range(per_lease):
                assert lease.exec("echo hi", timeout=60).strip() == "hi"

        threads = [threading.Thread(target=calls, args=(lease,)) for lease in leases]
        monitor.cpu_begin()
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        cpu = monitor.cpu_end()
        for lease in leases:
            lease.close()
    finally:
        if monitor:
            monitor.stop()
        stack.stop()
    done = per_lease * args.concurrency
    per_call = cpu_per_episode(cpu, done)
    ms = {k: round(per_call[k] * 1000, 2) for k in SHOWN if k in per_call}
    print(json.dumps({"calls": done, "concurrency": args.concurrency, "wall_s": round(wall, 2), "cpu_ms_per_call": ms}))


if __name__ == "__main__":
    main()
