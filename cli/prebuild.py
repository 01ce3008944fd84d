"""`dataset prebuild`: every task's images ready ahead of the first episode.

For the pool (the default), one job per task goes to the build queue of a serving host, round
robin, and runs the code a run's image step runs (tasks/prebuild_jobs.py): a pool of H hosts
builds M tasks in about M/H build times, each pushed to the pool's registry; `--hosts all`
then has every other host pull each. `--hosts here` calls environments.task_builds directly
with this machine's Docker. Either way under the workers' own Redis locks, so a prebuild and
a worker never build one image twice at once.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from poolcore.config import Settings
from poolcore.state import Store


@dataclass
class BuildResult:
    task: str
    path: Path
    status: str  # built / pulled / present (already there) / failed
    image: str = ""
    seconds: float = 0.0
    error: str = ""
    host: str = "here"

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "path": str(self.path),
            "status": self.status,
            "image": self.image,
            "seconds": round(self.seconds, 1),
            "error": self.error,
            "host": self.host,
        }


def lock_store(cfg: Settings) -> Store:
    """The state store whose locks serialise builds of one image on this host; checked now (an
    operator's command: a Redis that is away is said at once, not waited for)."""
    store = Store.connect(cfg, wait_out=False)
    store.ping()
    return store


def build_one(task_dir: Path, label: str, cfg: Settings, timeout: float, locks: Store) -> BuildResult:
    from environments.task_builds import ensure_images  # imports the docker SDK: only when building

    started = time.monotonic()
    try:
        lock = functools.partial(locks.build_lock, cfg.host_id)
        image, status = ensure_images(task_dir.name, task_dir, cfg, timeout, lock, locks)
    except Exception as exc:  # one task's failure is a row of the report, not the end of it
        text = str(exc).strip() or type(exc).__name__
        if not isinstance(exc, (RuntimeError, TimeoutError)):
            text = f"{type(exc).__name__}: {text}"
        return BuildResult(label, task_dir, "failed", seconds=time.monotonic() - started, error=text)
    return BuildResult(label, task_dir, status, image=image, seconds=time.monotonic() - started)


def build_all(
    tasks: list[tuple[Path, str]], cfg: Settings, timeout: float, jobs: int, locks: Store, on_done=None
) -> list[BuildResult]:
    """Build N at a time; results in the order of tasks."""
    results: dict[Path, BuildResult] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="prebuild") as pool:
        futures = {pool.submit(build_one, path, label, cfg, timeout, locks): path for path, label in tasks}
        for future in as_completed(futures):
            result = future.result()
            results[futures[future]] = result
            if on_done:
                on_done(result)
    return [results[path] for path, _ in tasks]


# ---- the pool's prebuild: spread over the build queues of the serving hosts ---------------------
def serving_hosts(engine) -> list[str]:
    """The hosts that serve now (not draining, not lost), as /status judges them once this
    process has watched their heartbeats for a beat's time."""
    from poolcore.hosts import look

    look(engine.watch)
    return sorted(host for host, info in engine.host_overview().items() if info["state"] == "serving")


def send_builds(celery, hosts: list[str], task_paths: list[str], batch: str, timeout: float) -> list[tuple]:
    """One job per task, round robin over `hosts` (each host builds its share, one at a time per
    build worker); (host, task path) of each job sent."""
    sent = []
    for index, task_path in enumerate(task_paths):
        host = hosts[index % len(hosts)]
        celery.send_task(
            "pool.prebuild_task", kwargs=dict(host=host, batch=batch, task_path=task_path, timeout=timeout)
        )
        sent.append((host, task_path))
    return sent


def send_pulls(celery, hosts: list[str], ready: list[tuple], batch: str, timeout: float) -> list[tuple]:
    """Each task made ready (host, task path) on every other host: pulled from the pool's
    registry (`--hosts all`); a job id of its own (a new batch key per host and task)."""
    sent = []
    for made_on, task_path in ready:
        for host in hosts:
            if host != made_on:
                kwargs = dict(host=host, batch=batch, task_path=task_path, timeout=timeout)
                celery.send_task("pool.prebuild_task", kwargs=kwargs)
                sent.append((host, task_path))
    return sent


def wait_results(store: Store, batch: str, expected: list[tuple], deadline: float, on_done=None) -> dict:
    """(host, task path) -> result of each job of `expected` that answered before `deadline`."""
    seen: dict = {}
    while len(seen) < len(expected) and time.monotonic() < deadline:
        for key, result in store.prebuild_results(batch).items():
            if key in expected and key not in seen:
                seen[key] = result
                if on_done:
                    on_done(key, result)
        time.sleep(0.5)
    return seen


def pool_result(path: Path, label: str, host: str, answer: dict | None) -> BuildResult:
    """One job's row of the report; a job that never answered (its host stopped) failed."""
    if answer is None:
        return BuildResult(label, path, "failed", error=f"host {host} did not answer in time", host=host)
    return BuildResult(label, path, answer["status"], answer["image"], answer["seconds"], answer.get("error", ""), host)
