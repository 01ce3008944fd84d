"""Forking a run against its floor and against replaying its prefix (issue 21, item 4).

    python -m bench.fork [--sizes 10,200] [--counts 1,4,8] [--repeats 5] [--out bench/results] [--processes]

Starts its own stack (devstack, the fixture task hello-file). For each size S (MB written into
the run) and count K, repeated and interleaved in one process:
  * fork:   run.fork(K) through termpool.client until all K children are ready (the fork job:
            commit, K starts from the committed image, sessions carried; HTTP long polls);
  * floor:  the least the same can cost: `docker commit` of the run's container (paused, as
            termpool does) and K create+start of the committed image from K threads at once;
  * replay: what a trainer does without forks: K fresh runs at once (POST /v1/runs), each
            replaying the 10-step prefix that made the parent (S MB written, 9 echo calls).
Figures are p50 over the repeats, in seconds; ratio = fork / floor (the issue's target: <= 1.3).
--processes: the stack's host is a second dockerd with --experimental and CRIU 4.2
(devstack/criu.py), and the parent runs a background loop, so each fork carries its processes
(pause, checkpoint, commit, K restores); the floor stays commit + K plain starts.
The machine may be shared: the load average before and after is in the results.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from devstack import Stack, criu
from devstack.second_docker import SecondDocker
from environments.docker_client import docker_client
from termpool.client import Pool

TASK = "hello-file"
PREFIX_STEPS = 10


def prefix(size_mb: int) -> list[str]:
    """The 10 commands that make the parent: S MB of data, then nine small steps."""
    write = f"head -c {size_mb * 1024 * 1024} /dev/urandom > /app/blob.bin && sync"
    return [write, *[f"echo step {i} >> /app/steps.txt" for i in range(2, PREFIX_STEPS + 1)]]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fork_once(pool: Pool, parent, count: int, processes: bool = False) -> float:
    children = []
    seconds = timed(lambda: children.extend(parent.fork(count)))
    said = {child.info().get("processes_reason") or "carried" for child in children} if processes else set()
    for child in children:
        child.close(wait=True)
    if said - {"carried"}:  # a fork that fell back to restarting is not what --processes measures
        raise RuntimeError(f"processes were not carried: {said}")
    return seconds


def floor_once(parent_container, count: int) -> float:
    """docker commit (paused) + K create+start from K threads at once; then cleaned up."""
    client = docker_client()
    tag = f"tpbench-fork-floor:{uuid.uuid4().hex[:12]}"
    made = []

    def start(_):
        container = client.containers.create(
            tag, entrypoint=["sh", "-c", "sleep infinity"], command=[], mem_limit="1g", init=True, privileged=False
        )
        container.start()
        made.append(container)

    def work():
        parent_container.commit(*tag.split(":"), pause=True)
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(start, range(count)))

    try:
        return timed(work)
    finally:
        for container in made:
            container.remove(force=True)
        client.images.remove(tag)


def replay_once(pool: Pool, size_mb: int, count: int) -> float:
    """K fresh runs at once, each replaying the prefix; closed afterwards (not timed)."""
    runs = []

    def one(_):
        run = pool.start(TASK)
        runs.append(run)
        for command in prefix(size_mb):
            run.exec(command, timeout=120)

    with ThreadPoolExecutor(count) as threads:
        seconds = timed(lambda: list(threads.map(one, range(count))))
    for run in runs:
        run.close(wait=True)
    return seconds


LOOP = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done"


def measure(pool: Pool, sizes, counts, repeats: int, processes: bool = False) -> list[dict]:
    rows = []
    for size in sizes:
        with pool.start(TASK) as parent:
            for command in prefix(size):
                parent.exec(command, timeout=120)
            if processes:  # a session whose process the forks carry
                parent.exec(LOOP, id="loop", block=False)
            [container] = docker_client().containers.list(filters={"label": f"termpool.run={parent.id}"})
            for count in counts:
                samples = {"fork": [], "floor": [], "replay": []}
                failures = []
                for _ in range(repeats):  # interleaved, so a load change hits all three alike
                    for name, once in (
                        ("fork", functools.partial(fork_once, pool, parent, count, processes)),
                        ("floor", functools.partial(floor_once, container, count)),
                        ("replay", functools.partial(replay_once, pool, size, count)),
                    ):
                        try:
                            samples[name].append(once())
                        except Exception as exc:  # a shared machine's Docker hiccup: noted, not measured
                            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
                p50 = {name: statistics.median(values) for name, values in samples.items()}
                rows.append(
                    {
                        "size_mb": size,
                        "count": count,
                        **{f"{name}_p50": round(value, 3) for name, value in p50.items()},
                        "fork_over_floor": round(p50["fork"] / p50["floor"], 2),
                        "replay_over_fork": round(p50["replay"] / p50["fork"], 2),
                        "samples": {name: [round(v, 3) for v in values] for name, values in samples.items()},
                        "failures": failures,
                    }
                )
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [
        f"# Fork benchmark, {result['date']}",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; load average (1, 5, 15 min) before {result['load_before']}, "
        f"after {result['load_after']} (shared with other work)  ",
        f"p50 over {result['repeats']} repeats, seconds until all K children are ready.",
        "",
        "| MB written | K | fork | floor (commit + K create+start) | fork / floor | replay (K resets + 10 steps) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['size_mb']} | {row['count']} | {row['fork_p50']:.2f} | {row['floor_p50']:.2f} "
            f"| {row['fork_over_floor']:.2f} | {row['replay_p50']:.2f} |"
        )
    failed = [f"- {row['size_mb']} MB, K={row['count']}: {f}" for row in result["rows"] for f in row["failures"]]
    if failed:
        lines += ["", "Samples that failed (left out of the figures):", *failed]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,200")
    parser.add_argument("--counts", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--processes", action="store_true", help="fork with process carry (CRIU)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(c) for c in args.counts.split(",")]
    env = {"WORKER_MAX_RUNS_PER_TASK": str(2 * max(counts) + 2), "WARM_POOL_SIZE": "0", "LOG_LEVEL": "WARNING"}
    daemon = carrying_daemon(env) if args.processes else None
    stack = Stack(env=env).start()
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        with Pool(stack.url, retries=0) as pool:
            rows = measure(pool, sizes, counts, args.repeats, args.processes)
    finally:
        stack.stop()
        if daemon:
            daemon.stop()
    date = time.strftime("%Y%m%d-%H%M", time.gmtime())
    result = {
        "date": date,
        "command": "python -m bench.fork "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "processes").replace("_", "-")
        + (" --processes" if args.processes else ""),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "repeats": args.repeats,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fork-{date}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"fork-{date}.md").write_text(markdown(result))
    print(markdown(result))


def carrying_daemon(env: dict) -> SecondDocker:
    """A second dockerd that carries processes; the stack's workers and this process use it."""
    folder = criu.ensure()
    daemon = SecondDocker(experimental=True, path_first=str(folder), args=criu.dockerd_args()).start()
    subprocess.run(["bash", "tests/base_image.sh"], check=True, capture_output=True)
    daemon.load_image("termpool-test-base:bookworm")
    env.update(DOCKER_HOST=daemon.host, PATH=f"{folder}:{os.environ['PATH']}")
    os.environ["DOCKER_HOST"] = daemon.host  # the floor's docker_client()
    return daemon


if __name__ == "__main__":
    main()
