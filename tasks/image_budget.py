"""The host's image disk budget (IMAGE_DISK_BUDGET, environments/image_budget.py): each use of a
task image noted in the state store as it happens (a run's start, a warm spare's, a build), and
the reconcile's sweep that removes the least recently used ones beyond the budget. With no
budget set nothing is noted and nothing swept."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from environments import image_budget
from poolcore.config import settings
from tasks.runtime import store

log = logging.getLogger(__name__)


def note_built(host: str, image: str, task_path: str) -> None:
    """A build (or the check that found it built) of `image`, the task's agent image."""
    if settings().image_disk_budget:
        store().note_image_use(host, image, task_path)


def note_started(host: str, task_path: str, container: str) -> None:
    """A run or a warm spare started (or a run served by a spare): its agent container's
    image is used now. Never fails its caller: a use not noted only makes the image look older."""
    if not settings().image_disk_budget:
        return
    try:
        image = image_budget.built_as(container)
        if image:
            store().note_image_use(host, image, task_path)
    except Exception:
        log.warning("could not note the use of %s's image", container, exc_info=True)


def keep_within_budget(host: str, live_tasks: set[str]) -> list[str]:
    """The reconcile's step: remove this host's least recently used task images nothing uses
    until the rest fit in the budget; the ids (12 hex digits) of those removed. The images of
    `live_tasks` (task paths of the host's live runs) are kept as if in use: a run queued to
    start from one has no container yet, and a compose start does not build what is missing."""
    budget = settings().image_disk_budget
    if not budget:
        return []
    uses, tasks = store().image_uses(host), store().image_tasks(host)
    images = [
        replace(image, in_use=image.in_use or tasks.get(image.built_as) in live_tasks)
        for image in image_budget.host_images(host, uses, budget)
    ]
    # Uses of images no longer on the host (removed by this sweep's predecessors, an upload's
    # expiry, an operator) are forgotten: the record stays as large as the host's images.
    store().forget_image_uses(host, sorted(set(uses) - {image.built_as for image in images}))
    lock = functools.partial(store().build_lock, host)
    removed = image_budget.keep_within(images, budget, lock, functools.partial(forget_ready, host))
    return [image.id.removeprefix("sha256:")[:12] for image in removed]


def forget_ready(host: str, image: str) -> None:
    """`image` (an agent image's name) is gone from `host`: the task it was last used for is no
    longer marked as built there, so its next start builds (or pulls) it again instead of
    failing. The one place the budget clears images:<h>, keyed by task path today."""
    task_path = store().image_task(host, image)
    if task_path:
        store().mark_image_ready(host, task_path, False)
