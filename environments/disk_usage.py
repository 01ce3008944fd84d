"""What a host's runs hold on disk, and how much room the host has left.

A run's disk use is the sum over its containers' writable layers (overlay2's upper dir), its
named volumes and the host folder its containers write logs to (its run dir). Each is measured
by a walk of the folder that adds up allocated blocks (st_blocks: a sparse file counts what it
holds), not by `docker inspect --size`, which walks the same upper dir inside dockerd and is
slower (docs/operations.md, "Disk"). tmpfs mounts are memory, charged to the container's memory
limit, so they are not counted here.

Where the storage driver can enforce a size (overlay2 on xfs mounted with pquota), a run's
containers are also created with `storage_opt={"size": limit}` (storage_quota): a write past it
fails with ENOSPC at once instead of at the next check.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import docker.errors

from environments.docker_client import HOST_LABEL, MANAGED_LABEL, RUN_LABEL, docker_client
from termpool.disk import Space

log = logging.getLogger(__name__)


def folder_bytes(path: str | os.PathLike, follow_top_links: bool = False) -> int:
    """Bytes allocated to the files under `path` (0 when it is gone), without following links
    (with follow_top_links, links directly in `path` are followed: a warm run's log folders)."""
    if not path:
        return 0
    total, stack = 0, [os.fspath(path)]
    first = True
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    follow = first and follow_top_links
                    try:
                        if entry.is_dir(follow_symlinks=follow):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=follow).st_blocks * 512
                    except OSError:  # removed meanwhile
                        continue
        except OSError:
            pass
        first = False
    return total


def _upper_dir(container) -> str:
    data = ((container.attrs or {}).get("GraphDriver") or {}).get("Data") or {}
    return data.get("UpperDir") or ""


def host_usage(host: str) -> dict[str, int]:
    """Bytes held by each run (by the run or warm id its resources are labelled with) on this
    host: container writable layers and named volumes. A layer or volume this process cannot
    see (a worker in a container without Docker's data root) counts 0."""
    client = docker_client()
    mine = {"label": [f"{HOST_LABEL}={host}", MANAGED_LABEL]}
    usage: dict[str, int] = {}
    for container in client.containers.list(all=True, filters=mine, ignore_removed=True):
        owner = container.labels.get(RUN_LABEL, "")
        usage[owner] = usage.get(owner, 0) + folder_bytes(_upper_dir(container))
    for volume in client.volumes.list(filters=mine):
        owner = (volume.attrs.get("Labels") or {}).get(RUN_LABEL, "")
        usage[owner] = usage.get(owner, 0) + folder_bytes(volume.attrs.get("Mountpoint") or "")
    return usage


@functools.lru_cache(maxsize=1)
def data_root() -> str:
    """Docker's data root as dockerd reports it ('' when Docker cannot be asked)."""
    try:
        return docker_client().info().get("DockerRootDir") or ""
    except (docker.errors.DockerException, OSError):
        log.warning("could not ask Docker for its data root", exc_info=True)
        return ""


def spaces(output_root: Path) -> list[Space]:
    """Free space of Docker's data root (when this process sees it) and of the output root."""
    out = []
    for root, path in (("docker", data_root()), ("output", str(output_root))):
        if path and os.path.isdir(path):
            usage = shutil.disk_usage(path)
            out.append(Space(root, path, usage.free, usage.total))
    return out


QUOTA_PROBE = "1g"


@functools.lru_cache(maxsize=1)
def storage_quota() -> str:
    """Whether the storage driver enforces a container size here: 'overlay2/xfs pquota' when a
    trial create with storage_opt succeeded, else '' (the periodic check alone enforces it).
    Only tried on overlay2 over xfs, the one driver and file system that may take it."""
    try:
        info = docker_client().info()
        status = dict(info.get("DriverStatus") or [])
        if info.get("Driver") != "overlay2" or status.get("Backing Filesystem") != "xfs":
            return ""
        images = docker_client().images.list()
        if not images:
            return ""
        probe = docker_client().containers.create(images[0].id, storage_opt={"size": QUOTA_PROBE})
        probe.remove(force=True)
        return "overlay2/xfs pquota"
    except docker.errors.APIError as exc:  # "--storage-opt is supported only for overlay over xfs with 'pquota'"
        log.info("no storage quota on this host: %s", exc)
        return ""
    except (docker.errors.DockerException, OSError):
        log.warning("could not check the storage driver for quotas", exc_info=True)
        return ""
