"""Profile termpool's own processes under load: whole pool-API episodes at concurrency c while
py-spy samples every stack process (facade, each Celery worker kind, beat, Flower if asked).

    python -m bench.profile [--seconds 20] [--concurrency 8] [--flower] [--out /tmp/termpool-profile]

py-spy samples only the thread holding the GIL (`--gil`: a thread blocked on a socket, a lock
or the event loop's poll has released it), so a process's sample count over the window is
roughly the CPU time of its Python code (C work without the GIL, e.g. in the kernel, is not
seen). For each process it prints that count, where the on-CPU samples end (by package: celery, kombu, redis-py, termpool's own
modules, ...), the leaf functions that take the most samples, and the termpool frames under
which the most samples fall (inclusive). Raw collapsed stacks are kept in `<out>-<name>.txt`.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import threading
import time
from pathlib import Path

from bench.episodes import BenchClient, pool_episode
from bench.run import start_flower
from bench.stats import Recorder
from devstack import Stack

OWN_MODULES = ("app/", "tasks/", "termpool/", "environments/")
# Where a sample's leaf frame lives, by the first matching path fragment.
PACKAGES = (
    ("celery/", "celery"),
    ("kombu/", "kombu"),
    ("redis/", "redis-py"),
    ("docker/", "docker SDK"),
    ("requests/", "requests"),
    ("urllib3/", "urllib3"),
    ("gunicorn/", "gunicorn"),
    ("flask/", "flask"),
    ("werkzeug/", "werkzeug"),
    ("tornado/", "tornado"),
    ("flower/", "flower"),
    ("json/", "json"),
    ("logging/", "logging"),
    ("threading.py", "threading"),
    ("socket.py", "socket"),
    *((m, f"termpool {m.rstrip('/')}") for m in OWN_MODULES),
)


def package_of(frame: str) -> str:
    for fragment, name in PACKAGES:
        if fragment in frame:
            return name
    return "other"


def read_stacks(raw: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if frames and count.isdigit():  # py-spy may add a line of its own (a warning), not a stack
            out.append((frames, int(count)))
    return out


def consumers(stacks: list[tuple[list[str], int]], top: int) -> dict:
    """Samples in all, by the leaf frame's package, by leaf function, and termpool frames inclusive."""
    total = sum(n for _, n in stacks)
    by_package: collections.Counter = collections.Counter()
    by_leaf: collections.Counter = collections.Counter()
    own_inclusive: collections.Counter = collections.Counter()
    for frames, n in stacks:
        by_package[package_of(frames[-1])] += n
        by_leaf[frames[-1]] += n
        for frame in {f for f in frames if any(m in f for m in OWN_MODULES)}:
            own_inclusive[frame] += n
    return {
        "samples": total,
        "by_package": by_package.most_common(top),
        "leaf": by_leaf.most_common(top),
        "own_inclusive": own_inclusive.most_common(top),
    }


def record(pid: int, out: Path, seconds: int, rate: int) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["py-spy", "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-d", str(seconds)]
    argv += ["-r", str(rate), "--nonblocking", "--subprocesses", "--gil"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def load(url: str, concurrency: int, tool_calls: int, stop: threading.Event, rec: Recorder) -> list[threading.Thread]:
    """c threads running pool-API episodes back to back until `stop` is set."""

    def worker(index: int) -> None:
        client = BenchClient(url)
        try:
            while not stop.is_set():
                rec.episode_done(pool_episode(client, rec, f"hello-file#{index // 8}", tool_calls))
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tool-calls", type=int, default=10)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--flower", action="store_true", help="run Flower against the stack")
    parser.add_argument("--out", default="/tmp/termpool-profile")
    args = parser.parse_args()
    stack = Stack(beat=True).start()
    rec, stop = Recorder(), threading.Event()
    try:
        if args.flower:
            start_flower(stack)
        warm = Recorder()
        pool_episode(BenchClient(stack.url), warm, "hello-file#warm", 1)  # builds the image if needed
        threads = load(stack.url, args.concurrency, args.tool_calls, stop, rec)
        time.sleep(5)  # every thread in its episodes before sampling starts
        names = [name for name in stack.procs if name != "redis"]
        samplers = {
            name: record(stack.procs[name].pid, Path(f"{args.out}-{name}.txt"), args.seconds, args.rate)
            for name in names
        }
        for name, proc in samplers.items():
            _, err = proc.communicate()
            if proc.returncode:
                print(f"py-spy on {name} failed: {err.strip()[-500:]}")
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    finally:
        stop.set()
        stack.stop()
    print(
        f"{rec.episodes_ok} episodes at c={args.concurrency} ({rec.error_count} errors); "
        f"py-spy at {args.rate} Hz for {args.seconds} s on each process: 100 samples = 1 CPU-second"
    )
    for name in names:
        found = consumers(read_stacks(Path(f"{args.out}-{name}.txt")), args.top)
        total = found["samples"] or 1
        print(f"\n== {name}: {found['samples']} on-CPU samples")
        print("   by package (leaf frame): " + ", ".join(f"{p} {n * 100 / total:.0f}%" for p, n in found["by_package"]))
        print("   leaf functions:")
        for frame, n in found["leaf"]:
            print(f"   {n * 100 / total:5.1f}%  {frame[:120]}")
        print("   termpool frames (inclusive):")
        for frame, n in found["own_inclusive"]:
            print(f"   {n * 100 / total:5.1f}%  {frame[:120]}")


if __name__ == "__main__":
    main()
