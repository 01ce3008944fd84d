"""Task images termpool builds: their labels, and the reconcile's removal of replaced ones.

A task image rebuilt under the same name (a dataset update) leaves the image it replaces on
disk, untagged ("dangling"), for as long as anything still uses it and after. Each task image
termpool builds is labelled with the building host and the image whose build lock the build
held, so a host's reconcile can find its own untagged ones and remove those nothing uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import docker.errors

from environments.docker_client import TASK_IMAGE_LABEL, TASK_IMAGE_LOCK_LABEL, docker_client
from environments.forking import FORK_LABEL

if TYPE_CHECKING:
    from poolcore.state import OwnedLock

log = logging.getLogger(__name__)


def build_labels(host: str, image: str) -> dict:
    """The labels of every image a build of `image` (the task's agent image, the key of its
    build lock) makes on `host`: the agent's and, in a compose build, its sidecars'."""
    return {TASK_IMAGE_LABEL: host, TASK_IMAGE_LOCK_LABEL: image}


def remove_unused(host: str, build_lock: Callable[[str], OwnedLock]) -> list[str]:
    """Remove this host's untagged task images that nothing uses; return their short ids
    (12 hex digits, as `docker images` shows them).

    Docker decides what is used: an image is removed without force, so one that a container
    (running or stopped, of any run or warm spare) was created from, or that a committed
    image (a fork's) is made from, is refused (409) and kept. A fork's committed image
    carries its task image's labels too, but is tagged (and the fork's to remove). Each is
    removed under the build lock of the image it was built as, once seen untagged under it: a
    build on this host that gives the same image again (every step cached) tags it under that
    lock, and removing by id would take the newly tagged image away from the runs about to
    start from it. An image whose build runs now waits for the next sweep.
    """
    mine = {"dangling": True, "label": f"{TASK_IMAGE_LABEL}={host}"}
    removed = []
    # The listing's own fields (id, labels): no inspect per image, which one removed meanwhile
    # (a parent pruned with its child) would fail.
    for image in docker_client().api.images(filters=mine):
        labels = image.get("Labels") or {}
        if FORK_LABEL in labels:  # a fork's, however it lost its tag: its references decide
            continue
        lock = build_lock(labels.get(TASK_IMAGE_LOCK_LABEL, ""))
        if not lock.acquire():
            continue
        with lock:
            if _remove_if_untagged(image["Id"]):
                removed.append(image["Id"].removeprefix("sha256:")[:12])
    return removed


def remove_built(host: str, image: str, build_lock: Callable[[str], OwnedLock]) -> bool:
    """Remove every image a build of `image` made on this host (the agent's and its sidecars'),
    under its build lock: the reconcile's removal of an expired upload's images. True when none
    is left; one that a container or a committed image still uses is refused (409) and kept,
    for the next sweep. A fork's committed image is the fork code's to remove."""
    lock = build_lock(image)
    if not lock.acquire():
        return False  # a build of it runs now: a run of the task came back
    left = 0
    with lock:
        mine = {"label": [f"{TASK_IMAGE_LABEL}={host}", f"{TASK_IMAGE_LOCK_LABEL}={image}"]}
        for found in docker_client().api.images(filters=mine):
            if FORK_LABEL not in (found.get("Labels") or {}):
                left += not remove_image(found["Id"], found.get("RepoTags") or [])
    return left == 0


def remove_image(image_id: str, tags: list[str]) -> bool:
    """Untag each of an image's names (its last one removes it); by id when it has none. False
    when Docker refuses (409: a container or another image uses it), never forced."""
    names = [t for t in tags if t != "<none>:<none>"] or [image_id]
    for name in names:
        try:
            docker_client().images.remove(name)
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:
                raise
            log.info("task image %s is still in use: %s", name, exc.explanation or exc)
            return False
    return True


def _remove_if_untagged(image_id: str) -> bool:
    client = docker_client()
    try:
        if client.api.inspect_image(image_id).get("RepoTags"):
            return False  # tagged again since the listing: a build's result now
        client.images.remove(image_id)
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as exc:
        if exc.status_code != 409:
            raise
        log.info("task image %s is still in use: %s", image_id[:19], exc.explanation or exc)
        return False
    return True
