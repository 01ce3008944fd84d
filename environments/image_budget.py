"""A host's task images kept within IMAGE_DISK_BUDGET: the reconcile removes the least recently
used ones that nothing needs until what is left fits.

Which images count: every image termpool built on this host (TASK_IMAGE_LABEL names the host)
or pulled from the pool's registry and used here, tagged or not, dataset and uploaded tasks alike, but not a fork's committed image (FORK_LABEL:
the fork code removes it when no run needs it, and it cannot be removed before). Each counts its
size as the image listing gives it (`docker images`' SIZE: all its layers), so layers several
images share (a common base image) are counted once per image: the sum is an upper bound of
the disk they hold, and the budget errs on the side of removing more.

Last use: the time noted in the state store when a run or a warm spare started from the image
or a build made it (tasks/image_budget.py), or the image's creation when later. An image is
named in the store by the image its build held the lock of (TASK_IMAGE_LOCK_LABEL): a compose
task's sidecar images share the agent's last use.

Docker decides what is in use: nothing is removed by force, so an image a container (running or
stopped: a live run's, a warm spare's) was created from, or that another image is made from (a
fork's commit), is refused (409) and kept. Images known to be in use are not even tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import docker.errors

from environments.docker_client import TASK_IMAGE_LABEL, TASK_IMAGE_LOCK_LABEL, docker_client
from environments.forking import FORK_LABEL
from environments.image_digest import CONTENT_LABEL
from environments.task_images import remove_image

if TYPE_CHECKING:
    from poolcore.state import OwnedLock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskImage:
    id: str
    built_as: str  # the image whose build lock its build held (the agent's image name)
    size: int  # bytes, as the listing gives them (shared layers counted in each image)
    last_used: float  # epoch seconds
    in_use: bool  # a container was created from it, or another image is made from it


def choose(images: list[TaskImage], budget: int) -> list[TaskImage]:
    """The images to remove so that the rest fit in `budget` bytes: least recently used first,
    never one in use. Fewer (or none) when those in use alone exceed the budget."""
    total = sum(image.size for image in images)
    chosen = []
    for image in sorted((i for i in images if not i.in_use), key=lambda i: (i.last_used, i.id)):
        if total <= budget:
            break
        chosen.append(image)
        total -= image.size
    return chosen


def host_images(host: str, uses: dict[str, float], budget: int) -> list[TaskImage]:
    """This host's task images (not a fork's committed ones) with their sizes, last uses (from
    `uses`: built_as -> time noted) and, when they exceed `budget`, whether they are in use now
    (within it nothing is removed: Docker is not asked)."""
    found = []
    for image in _task_images(host, uses):
        labels = image.get("Labels") or {}
        built_as = labels.get(TASK_IMAGE_LOCK_LABEL, "")
        last_used = max(uses.get(built_as, 0.0), float(image.get("Created") or 0))
        found.append(TaskImage(image["Id"], built_as, int(image.get("Size") or 0), last_used, False))
    if sum(image.size for image in found) <= budget:
        return found
    in_use = images_in_use()
    return [replace(image, in_use=image.id in in_use) for image in found]


def _task_images(host: str, uses: dict[str, float]) -> list[dict]:
    """The listing of the task images this host built, and of those it pulled from the pool's
    registry (built on another host, so labelled with that host: counted here once this host
    noted a use of them); not a fork's committed images."""
    listing = {
        image["Id"]: image for image in docker_client().api.images(filters={"label": f"{TASK_IMAGE_LABEL}={host}"})
    }
    for image in docker_client().api.images(filters={"label": CONTENT_LABEL}):
        if (image.get("Labels") or {}).get(TASK_IMAGE_LOCK_LABEL) in uses:
            listing.setdefault(image["Id"], image)
    return [image for image in listing.values() if FORK_LABEL not in (image.get("Labels") or {})]


def images_in_use() -> set[str]:
    """Ids of the images Docker would refuse to remove unforced: those a container (of any
    host's runs, running or stopped) was created from, and the parents of other images (a
    fork's commit is made from its run's image; an image built FROM another with the classic
    builder has it in its chain of parents)."""
    client = docker_client()
    used = {c.get("ImageID") for c in client.api.containers(all=True)}
    used |= {image.get("ParentId") for image in client.api.images(all=True)}
    return {image_id for image_id in used if image_id}


def keep_within(
    images: list[TaskImage],
    budget: int,
    build_lock: Callable[[str], OwnedLock],
    forget: Callable[[str], None],
) -> list[TaskImage]:
    """Remove images as `choose` picks them until the rest fit in `budget`; return those
    removed. One Docker refuses (a start since the listing) or whose build runs now counts as
    in use and the choice is made again without it; one already gone (another sweep at once:
    each worker's start sends one) counts as removed, so two sweeps remove no more than one.
    `forget(built_as)` runs under the image's build lock after each removal: its task's image
    is no longer ready on this host."""
    removed: list[TaskImage] = []
    pending = images
    while batch := choose(pending, budget):
        outcome = {image.id: _remove_under_lock(image, build_lock, forget) for image in batch}
        removed += [image for image in batch if outcome[image.id] == "removed"]
        kept = {image_id for image_id, what in outcome.items() if what == "kept"}
        pending = [replace(i, in_use=i.in_use or i.id in kept) for i in pending if outcome.get(i.id) in (None, "kept")]
    return removed


def _remove_under_lock(image: TaskImage, build_lock: Callable[[str], OwnedLock], forget) -> str:
    """What became of it: removed, gone (removed meanwhile) or kept (refused, its build runs). Under
    the build lock of the image it was built as, as task_images.remove_unused does: a build of
    it now (every step cached gives this very image) would have its result taken away."""
    lock = build_lock(image.built_as)
    if not lock.acquire():
        return "kept"
    with lock:
        try:  # its names now: one may have moved to a newer image since the listing
            tags = docker_client().api.inspect_image(image.id).get("RepoTags") or []
        except docker.errors.ImageNotFound:
            return "gone"
        if not remove_image(image.id, tags):
            return "kept"
        forget(image.built_as)
    used = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(image.last_used))
    log.warning(
        "image budget: removed task image %s (%s, %.1f MB, last used %s UTC)",
        image.id.removeprefix("sha256:")[:12],
        ", ".join(tags) or image.built_as,
        image.size / 1e6,
        used,
    )
    return "removed"


def built_as(container: str) -> str:
    """The image a container's task image was built as ("" for none of termpool's builds): a
    container carries its image's labels."""
    labels = docker_client().api.inspect_container(container)["Config"].get("Labels") or {}
    return labels.get(TASK_IMAGE_LOCK_LABEL, "")
