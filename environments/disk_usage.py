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

import logging
import os
import shutil
import threading
from pathlib import Path

import docker.errors

from environments.docker_client import HOST_LABEL, MANAGED_LABEL, RUN_LABEL, docker_client
from poolcore.disk import Space

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


# A container's writable layer stays where it is for the container's life: learnt once (an
# inspect) per container, not at every check (the SDK's containers.list inspects each one).
_upper_dirs: dict[str, str] = {}


def _upper_dir(container_id: str) -> str:
    if container_id not in _upper_dirs:
        try:
            attrs = docker_client().api.inspect_container(container_id)
        except docker.errors.NotFound:  # removed since the listing
            return ""
        _upper_dirs[container_id] = ((attrs.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir") or ""
    return _upper_dirs[container_id]


def host_usage(host: str) -> dict[str, int]:
    """Bytes held by each run (by the run or warm id its resources are labelled with) on this
    host: container writable layers and named volumes. A layer or volume this process cannot
    see (a worker in a container without Docker's data root) counts 0. One listing of
    containers (its own fields: id, labels) and one of volumes; an inspect only for a
    container not seen before."""
    client = docker_client()
    mine = {"label": [f"{HOST_LABEL}={host}", MANAGED_LABEL]}
    usage: dict[str, int] = {}
    listed = client.api.containers(all=True, filters=mine)
    for container in listed:
        owner = (container.get("Labels") or {}).get(RUN_LABEL, "")
        usage[owner] = usage.get(owner, 0) + folder_bytes(_upper_dir(container["Id"]))
    for gone in set(list(_upper_dirs)) - {container["Id"] for container in listed}:
        _upper_dirs.pop(gone, None)  # (a check in another thread may have dropped it)
    for volume in client.volumes.list(filters=mine):
        owner = (volume.attrs.get("Labels") or {}).get(RUN_LABEL, "")
        usage[owner] = usage.get(owner, 0) + folder_bytes(volume.attrs.get("Mountpoint") or "")
    return usage


# What this worker process has learnt of its Docker (learn(), in a thread of its own at worker
# start): read by the heartbeat and by starts, which must never wait on a slow or absent dockerd.
_learnt = {"data_root": "", "storage_quota": ""}
LEARN_RETRY_SECONDS = 30.0


def learn(stop: threading.Event) -> None:
    """Ask Docker for its data root and whether its storage driver enforces a size, again every
    LEARN_RETRY_SECONDS until it answers (or `stop` is set)."""
    while not stop.is_set():
        try:
            info = docker_client().info()
            _learnt["storage_quota"] = _quota(info)
            _learnt["data_root"] = info.get("DockerRootDir") or ""
            return
        except (docker.errors.DockerException, OSError) as exc:
            log.warning("could not ask Docker about its disk (again in %g s): %s", LEARN_RETRY_SECONDS, exc)
        stop.wait(LEARN_RETRY_SECONDS)


def data_root() -> str:
    """Docker's data root ('' until learnt)."""
    return _learnt["data_root"]


def storage_quota() -> str:
    """'overlay2/xfs pquota' when the storage driver enforces a container size here, else ''
    (also until learnt): the periodic check alone enforces the limit then."""
    return _learnt["storage_quota"]


def spaces(output_root: Path) -> list[Space]:
    """Free space of Docker's data root (when this process sees it) and of the output root."""
    out = []
    for root, path in (("docker", data_root()), ("output", str(output_root))):
        if path and os.path.isdir(path):
            usage = shutil.disk_usage(path)
            out.append(Space(root, path, usage.free, usage.total))
    return out


QUOTA_PROBE = "1g"


def _quota(info: dict) -> str:
    """A trial create with storage_opt, only on overlay2 over xfs, the one driver and file
    system that may take it: 'overlay2/xfs pquota' when it succeeds, else ''."""
    status = dict(info.get("DriverStatus") or [])
    if info.get("Driver") != "overlay2" or status.get("Backing Filesystem") != "xfs":
        return ""
    images = docker_client().images.list()
    if not images:
        return ""
    try:
        probe = docker_client().containers.create(images[0].id, storage_opt={"size": QUOTA_PROBE})
    except docker.errors.APIError as exc:  # "--storage-opt is supported only for overlay over xfs with 'pquota'"
        log.info("no storage quota on this host: %s", exc)
        return ""
    probe.remove(force=True)
    return "overlay2/xfs pquota"
