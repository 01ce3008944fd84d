"""Profile the tool-call path: sequential `shell_exec echo hi` through the pool API while
py-spy samples the exec worker and the gunicorn workers.

    python -m bench.profile [--seconds 15] [--out /tmp/termpool-profile]

Writes py-spy's raw (collapsed) stacks per process and prints the hottest frames of each, and
the tool-call p50 of the run (with the sampler attached, so slower than the benchmark's).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import time
from pathlib import Path

from devstack import Stack

INTERESTING = ("tasks/", "app/", "termpool/", "publish", "blmove", "trace_task", "docker/api", "requests/")


def hottest(raw: Path, top: int = 25) -> list[tuple[int, str]]:
    """Frames by inclusive sample count, restricted to the ones that say where time goes."""
    inclusive: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        for frame in set(stack.split(";")):
            inclusive[frame] += int(count)
    return [(n, f) for f, n in inclusive.most_common(200) if any(k in f for k in INTERESTING)][:top]


def record(pid: int, out: Path, seconds: int, subprocesses: bool) -> subprocess.Popen:
    argv = [
        "py-spy",
        "record",
        "-p",
        str(pid),
        "-o",
        str(out),
        "-f",
        "raw",
        "-d",
        str(seconds),
        "-r",
        "200",
        "--nonblocking",
    ]
    return subprocess.Popen(argv + (["--subprocesses"] if subprocesses else []), stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--out", default="/tmp/termpool-profile")
    args = parser.parse_args()
    stack = Stack().start()
    try:
        lease = stack.client.allocate("hello-file").reset("hello-file")
        for _ in range(10):  # warm up connections and caches
            lease.exec("echo hi", timeout=60)
        samplers = {
            "exec": record(stack.procs["exec"].pid, Path(f"{args.out}-exec.txt"), args.seconds + 5, False),
            "web": record(stack.procs["web"].pid, Path(f"{args.out}-web.txt"), args.seconds + 5, True),
        }
        time.sleep(1)
        latencies, started = [], time.monotonic()
        while time.monotonic() - started < args.seconds:
            t0 = time.perf_counter()
            lease.exec("echo hi", timeout=60)
            latencies.append(time.perf_counter() - t0)
        for proc in samplers.values():
            proc.wait()
        lease.close()
    finally:
        stack.stop()
    print(f"{len(latencies)} tool calls, p50 {statistics.median(latencies) * 1000:.1f} ms (sampler attached)")
    for name in samplers:
        print(f"== {name}")
        for count, frame in hottest(Path(f"{args.out}-{name}.txt")):
            print(f"{count:6d}  {frame[:110]}")


if __name__ == "__main__":
    main()
