"""A host that runs for weeks: thousands of mixed episodes on one stack, sampling what could
accumulate every few hundred episodes, then the pool left idle past its TTLs and sampled again.

    python -m bench.soak --episodes 2000 --report-every 200 --concurrency 6 [--ttl-scale 1]

Starts its own stack (devstack, beat on, so the reaper and the reconcile run) with short
lifetimes (SHORT_TTLS, times --ttl-scale) so that "after the TTLs passed" comes within
minutes, runs the episode mix of bench/soak_episodes.py with --concurrency in flight, and
every --report-every episodes takes a sample (bench/soak_sample.py). After the last episode it
waits --idle seconds (default: the longest lifetime plus a reconcile period) and samples again.
Writes bench/results/soak-<time>.json (every sample, every verdict) and .md (the tables of
bench/soak_report.py). Exit status 1 when an episode failed unexpectedly or the stack left a
container, network or volume once stopped; 2 when it could not set up.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker.errors as docker_errors

from bench.density_host import left_behind, remove_left
from bench.output import emit
from bench.soak_episodes import MIX, Episodes, kind_of, scratch_folder
from bench.soak_report import analyse, markdown
from bench.soak_sample import Sampler
from devstack import ROOT, Stack
from environments.docker_client import TASK_IMAGE_LABEL, docker_client
from poolcore.state import IDEMPOTENCY_TTL

# Lifetimes shortened so the idle pool's end state is seen within minutes (seconds, x ttl-scale).
SHORT_TTLS = {
    "WORKER_RUN_IDLE_TTL": 30,
    "WORKER_ALLOCATED_TTL": 30,
    "WARM_IDLE_TTL": 30,
    "RECORD_TTL": 120,
    "UPLOADED_TASK_TTL": 120,
    "ARCHIVE_TTL": 60,
    "RUN_FOLDER_TTL": 60,
}
UPLOAD_IMAGES = "tb__sha256-"  # an uploaded task's images: tb__<folder name of its digest>__<service>
SETTLE = 60  # a reap period (10 s), a reconcile period (30 s) and a teardown after the TTLs
MESSAGES_KEPT = 20


def log(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def stack_env(scale: float, socket_dir: Path) -> dict:
    env = {name: str(max(60 if name == "RECORD_TTL" else 10, round(s * scale))) for name, s in SHORT_TTLS.items()}
    env.update(
        {
            "TEARDOWN_CONCURRENCY": "10",  # termpool's default (WORKER_MAX_CONCURRENT_CLOSES), not devstack's 4
            "WORKER_MAX_RUNS_PER_TASK": "16",  # a thread's runs, its forks and its reaped runs on one key
            "FORK_PROCESSES": "off",  # a fork commits files only: cheap on 2 cores
            "POOL_SOCKET_DIR": str(socket_dir),  # the stack's own, to measure it alone
        }
    )
    return env


class Soak:
    """The episodes in flight (threads taking the next index), the samples, the failures."""

    def __init__(self, stack: Stack, sampler: Sampler, total: int, every: int, concurrency: int):
        self.stack, self.sampler = stack, sampler
        self.total, self.every, self.concurrency = total, every, concurrency
        self.scratch = scratch_folder()
        self.lock = threading.Lock()
        self.next_index = self.done = 0
        self.failures: dict[str, int] = {}
        self.messages: list[str] = []
        self.samples: list[dict] = []

    def warm_up(self) -> None:
        """One episode of each kind but the reaper's, one after another: the images are built."""
        episodes = Episodes(self.stack.url, 0, self.scratch)
        try:
            for kind in MIX:
                if kind != "reaped":
                    log(f"warm-up: {kind}")
                    episodes.run(0, kind)
        finally:
            episodes.close()

    def take(self) -> int | None:
        with self.lock:
            if self.next_index >= self.total:
                return None
            self.next_index += 1
            return self.next_index - 1

    def worker(self, thread: int) -> None:
        episodes = Episodes(self.stack.url, thread, self.scratch)
        try:
            while (index := self.take()) is not None:
                self.one(episodes, index)
        finally:
            episodes.close()

    def one(self, episodes: Episodes, index: int) -> None:
        kind = kind_of(index)
        try:
            episodes.run(index, kind)
        except Exception as exc:
            with self.lock:
                self.failures[kind] = self.failures.get(kind, 0) + 1
                if len(self.messages) < MESSAGES_KEPT:
                    self.messages.append(f"#{index} {kind}: {type(exc).__name__}: {str(exc)[:300]}")
        with self.lock:
            self.done += 1

    def sample(self, episodes: int, phase: str) -> None:
        sample = self.sampler.sample(episodes, phase)
        self.samples.append(sample)
        rss = round(sum(sample["rss_mb"].values()))
        log(
            f"{phase} @ {episodes}: redis {sample['redis']['used_memory_mb']} MB / {sample['redis']['keys']} keys, "
            f"closing {sample['redis']['pending_closes']}, teardown queue {sample['redis']['queued']['teardown']}, "
            f"containers {sample['docker']['containers']}, rss {rss} MB, output {sample['disk']['output']['mb']} MB"
        )

    def run(self) -> float:
        """The episodes, sampled every `every` done; their rate (episodes per second)."""
        self.sample(0, "start")
        began = time.monotonic()
        threads = [threading.Thread(target=self.worker, args=(t + 1,), daemon=True) for t in range(self.concurrency)]
        for thread in threads:
            thread.start()
        reported = 0
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if self.done - reported >= self.every:
                reported = self.done - self.done % self.every
                log(f"{self.done} episodes, {self.done / (time.monotonic() - began):.2f}/s, failures {self.failures}")
                self.sample(reported, "soak")
        rate = self.total / (time.monotonic() - began)
        if reported < self.total:
            self.sample(self.total, "soak")
        return rate

    def idle(self, seconds: float, every: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(every, left))
            self.sample(self.total, "idle")


def remove_upload_images(docker, host_id: str) -> None:
    """The images of the uploaded tasks the stack built (the daemon is shared; the figures are
    taken). Never a dataset task's: its name is shared with other stacks on this daemon."""
    for image in docker.api.images(filters={"label": f"{TASK_IMAGE_LABEL}={host_id}"}):
        for name in image.get("RepoTags") or []:
            if name.startswith(UPLOAD_IMAGES):
                try:
                    docker.images.remove(name)
                except docker_errors.APIError:
                    pass  # still used: left to the host's reconcile, as any


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=2000)
    p.add_argument("--report-every", type=int, default=200, help="a sample every this many episodes")
    p.add_argument("--concurrency", type=int, default=6, help="episodes in flight")
    p.add_argument("--ttl-scale", type=float, default=1.0, help="times the short lifetimes of SHORT_TTLS")
    p.add_argument("--idle", type=float, help="seconds idle after the episodes (default: the TTLs + 60)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], capture_output=True).returncode:
        log("tests/base_image.sh failed")
        return 2
    stack = Stack(env={}, beat=True)
    socket_dir = stack.workdir / "sockets"
    socket_dir.mkdir()
    stack.env.update(stack_env(args.ttl_scale, socket_dir))
    stack.start()
    docker = docker_client()
    sampler = Sampler(stack, docker, socket_dir)
    soak = Soak(stack, sampler, args.episodes, args.report_every, args.concurrency)
    ttls = {k: int(v) for k, v in stack.env.items() if k in SHORT_TTLS}
    idle = args.idle if args.idle is not None else max(*ttls.values(), IDEMPOTENCY_TTL) + SETTLE
    try:
        soak.warm_up()
        rate = soak.run()
        log(f"idle for {idle:.0f} s")
        soak.idle(idle)
    finally:
        sampler.close()
        stack.stop()
    left = left_behind(docker, stack.host_id)
    remove_left(docker, left)
    remove_upload_images(docker, stack.host_id)
    result = {
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "episodes_per_s": round(rate, 3),
        "mix": MIX,
        "ttls": {**ttls, "IDEMPOTENCY_TTL": IDEMPOTENCY_TTL},
        "idle_s": idle,
        "failures": soak.failures,
        "failure_messages": soak.messages,
        "left_after_stop": left,
        "stack_logs": str(stack.workdir),
        "verdicts": analyse(soak.samples),
        "samples": soak.samples,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M")
    emit("bench.soak", result, out / f"soak-{stamp}.json")
    (out / f"soak-{stamp}.md").write_text(markdown(result["verdicts"], soak.samples))
    return 1 if soak.failures or any(left.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
