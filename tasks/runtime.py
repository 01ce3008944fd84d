"""What every job module of a worker process shares: the state store and run teardown."""

from __future__ import annotations

import functools

from environments import forking, lifecycle
from termpool.config import settings
from termpool.state import Store


@functools.lru_cache(maxsize=1)
def store() -> Store:
    return Store.from_url(settings().redis_url)


def remove_env(run_id: str, env: dict) -> int:
    """Remove a run's containers and networks (its warm container's too) and its socket folder;
    then the committed fork images that no other run needs (forking.py)."""
    removed = lifecycle.remove_run_resources(run_id, env.get("project", ""))
    if env.get("warm_id"):
        removed += lifecycle.remove_run_resources(env["warm_id"])
        store().warm_forget(env["warm_id"])
    lifecycle.remove_ctl_dir(env.get("ctl_dir", ""))
    for image in forking.remove_images(store().drop_images(run_id)):
        store().forget_image(image)
    return removed
