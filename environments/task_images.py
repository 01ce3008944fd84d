"""Task images termpool builds: their labels.

Each task image termpool builds is labelled with the building host and the image whose build
lock the build held, so a host can tell its own task images from every other image on the
daemon (a container made from one inherits these labels; the container labels of
docker_client.py say what a run owns).
"""

from __future__ import annotations

from environments.docker_client import TASK_IMAGE_LABEL, TASK_IMAGE_LOCK_LABEL


def build_labels(host: str, image: str) -> dict:
    """The labels of every image a build of `image` (the task's agent image, the key of its
    build lock) makes on `host`: the agent's and, in a compose build, its sidecars'."""
    return {TASK_IMAGE_LABEL: host, TASK_IMAGE_LOCK_LABEL: image}
