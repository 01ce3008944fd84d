"""`dataset prebuild`: build every task's images ahead of the first episode.

Calls environments.task_builds.ensure_image directly, the same code a build worker runs, with the
same per-host Redis lock, so a prebuild and a worker never build one image twice at once.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from termpool.config import Settings
from termpool.state import Store


@dataclass
class BuildResult:
    task: str
    path: Path
    status: str  # built / failed
    image: str = ""
    seconds: float = 0.0
    error: str = ""

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "path": str(self.path),
            "status": self.status,
            "image": self.image,
            "seconds": round(self.seconds, 1),
            "error": self.error,
        }


def lock_store(cfg: Settings) -> Store:
    """The state store whose locks serialise builds of one image on this host; checked now (an
    operator's command: a Redis that is away is said at once, not waited for)."""
    store = Store.connect(cfg, wait_out=False)
    store.ping()
    return store


def build_one(task_dir: Path, label: str, cfg: Settings, timeout: float, locks: Store) -> BuildResult:
    from environments.task_builds import ensure_image  # imports the docker SDK: only when building

    started = time.monotonic()
    try:
        image = ensure_image(task_dir.name, task_dir, cfg, timeout, functools.partial(locks.build_lock, cfg.host_id))
    except Exception as exc:  # one task's failure is a row of the report, not the end of it
        text = str(exc).strip() or type(exc).__name__
        if not isinstance(exc, (RuntimeError, TimeoutError)):
            text = f"{type(exc).__name__}: {text}"
        return BuildResult(label, task_dir, "failed", seconds=time.monotonic() - started, error=text)
    return BuildResult(label, task_dir, "built", image=image, seconds=time.monotonic() - started)


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
