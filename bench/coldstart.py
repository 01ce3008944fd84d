"""Where a cold start's time goes, step by step, under concurrency (issue 12, item 3).

    python -m bench.coldstart [--concurrency 8] [--rounds 4] [--task hello-file]

Runs, in this process and without the stack, what the lifecycle worker does for a reset
(environments.lifecycle.start, then session_helper.prepare_container) from c threads at once,
`rounds` times per thread, and between those rounds the benchmark's floor (a raw
containers.create + start with the same options as bench/episodes.py) from c threads. Each
Docker SDK call and compose run is timed where it happens (wrapped for the run's duration),
so the table shows per step: calls per start and the p50 / p95 of its wall time in ms, next
to the whole start and the floor. The image must exist (a bench run or a reset builds it).
Measured on a shared machine: compare figures of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import docker.api.container
import docker.api.exec_api

from bench.episodes import Floor
from devstack import FIXTURES, at_once
from environments import compose_config, lifecycle, session_helper
from environments.docker_client import HOST_LABEL, docker_client
from poolcore.config import load_settings

_local = threading.local()
_samples: dict[str, list[float]] = defaultdict(list)
_lock = threading.Lock()

# (owner, attribute, step name): the calls a start makes that cost a Docker or compose round trip.
TIMED = [
    (compose_config, "run_compose", "compose subprocess"),
    (docker.api.container.ContainerApiMixin, "create_container", "docker create"),
    (docker.api.container.ContainerApiMixin, "start", "docker start"),
    (docker.api.container.ContainerApiMixin, "inspect_container", "docker inspect"),
    (docker.api.container.ContainerApiMixin, "put_archive", "docker put_archive"),
    (docker.api.exec_api.ExecApiMixin, "exec_create", "docker exec_create"),
    (docker.api.exec_api.ExecApiMixin, "exec_start", "docker exec_start"),
    (docker.api.exec_api.ExecApiMixin, "exec_inspect", "docker exec_inspect"),
]


def _record(step: str, ms: float) -> None:
    if getattr(_local, "measuring", False):
        with _lock:
            _samples[step].append(ms)


def _timed(step: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _record(step, (time.perf_counter() - start) * 1000)

    return wrapper


@contextlib.contextmanager
def timing():
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in TIMED]
    for owner, attr, step in TIMED:
        setattr(owner, attr, _timed(step, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def termpool_start(cfg, task_dir: Path, workdir: Path) -> None:
    run_id = "cs" + uuid.uuid4().hex[:10]
    run = {"run_id": run_id, "task_key": task_dir.name, "task_meta": {"task_name": task_dir.name}}
    run_dir = workdir / run_id
    for sub in ("sessions", "agent-logs"):
        (run_dir / sub).mkdir(parents=True)
    _local.measuring = True
    start = time.perf_counter()
    env, container = lifecycle.start(run, task_dir, run_dir, cfg, 120)
    started = time.perf_counter()
    if not env.booted:  # else its tool server started with it (tp-session boot)
        session_helper.prepare_container(container, serve=bool(env.ctl_dir))
    done = time.perf_counter()
    _local.measuring = False
    _record_always("lifecycle.start", (started - start) * 1000)
    _record_always("prepare_container", (done - started) * 1000)
    _record_always("termpool start (total)", (done - start) * 1000)


def floor_start(floor: Floor, workdir: Path) -> None:
    name = "tpcs-floor-" + uuid.uuid4().hex[:10]
    run_dir = workdir / name
    for sub in ("sessions", "agent-logs"):
        (run_dir / sub).mkdir(parents=True)
    start = time.perf_counter()
    floor.create_start(name, run_dir)
    _record_always("floor create+start", (time.perf_counter() - start) * 1000)


def _record_always(step: str, ms: float) -> None:
    with _lock:
        _samples[step].append(ms)


def _together(concurrency: int, fn) -> None:
    errors = at_once(concurrency, fn)  # reported, the others go on
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]!r}")


def _cleanup(host: str) -> None:
    for container in docker_client().containers.list(all=True, filters={"label": f"{HOST_LABEL}={host}"}):
        with contextlib.suppress(Exception):
            container.remove(force=True, v=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--task", default="hello-file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tp-coldstart-") as tmp:
        workdir = Path(tmp)
        host = "cs" + uuid.uuid4().hex[:8]
        cfg = load_settings({**os.environ, "POOL_HOST_ID": host, "POOL_SOCKET_DIR": str(workdir / "sockets")})
        task_dir = FIXTURES / args.task
        image = compose_config.client_image(args.task, cfg)
        floor = Floor(docker_client(), image, cfg.container_memory_limit, task_dir, workdir, {HOST_LABEL: host})
        try:
            with timing():
                termpool_start(cfg, task_dir, workdir)  # the task's first start: compose template
                _samples.clear()
                for _ in range(args.rounds):
                    _together(args.concurrency, lambda: floor_start(floor, workdir))
                    _cleanup(host)
                    _together(args.concurrency, lambda: termpool_start(cfg, task_dir, workdir))
                    _cleanup(host)
        finally:
            _cleanup(host)
    starts = len(_samples["termpool start (total)"]) or 1
    print(f"c={args.concurrency}, {args.rounds} rounds, task {args.task}: ms per step")
    print(f"{'step':28} {'calls/start':>11} {'p50':>8} {'p95':>8} {'sum/start':>10}")
    for step, values in sorted(_samples.items(), key=lambda kv: -statistics.median(kv[1])):
        total = sum(values) / starts
        print(
            f"{step:28} {len(values) / starts:11.2f} {_pct(values, 0.5):8.0f} {_pct(values, 0.95):8.0f} {total:10.0f}"
        )


if __name__ == "__main__":
    main()
