"""Process carry for forks: a container's processes checkpointed with CRIU (through dockerd's
experimental checkpoints) and restored in a fork's child (docs/http-api.md, "Forking a run").

The source is checkpointed with its processes left running (POST /containers/{id}/checkpoints,
`Exit: false`), right before its commit, so the files the processes hold are in the committed
image the child starts from. dockerd refuses a checkpoint folder of one's choosing on start, so
the checkpoint is copied into the child container's own checkpoints folder
(<DockerRootDir>/containers/<id>/checkpoints/<name>: the worker runs on its daemon's host, as
environments/disk_usage.py assumes too) and the child is started from it
(POST /containers/{id}/start?checkpoint=<name>). Checkpoints are removed once used.

The Docker SDK has no checkpoint calls: they go through its public APIClient (a requests
session) to the documented Engine API endpoints.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from pathlib import Path

from environments.docker_client import docker_client

HELD_MAX = 65536  # bytes of a held file copied into a child (tp-session's lock file is empty)


class CheckpointFailed(RuntimeError):
    """dockerd (CRIU) could not checkpoint or restore; the message has its answer."""


def _url(path: str) -> str:
    api = docker_client().api
    return f"{api.base_url}/v{api.api_version}{path}"


def _check(reply, what: str) -> None:
    if reply.status_code >= 300:
        try:
            message = reply.json().get("message", reply.text)
        except ValueError:
            message = reply.text
        raise CheckpointFailed(f"{what}: {message.strip()[-400:]}{_criu_errors(message)}")


def _criu_errors(message: str) -> str:
    """CRIU's own error lines from the log dockerd's answer names (gone once the container is
    started afresh, so read now)."""
    found = re.search(r"(?:log file:|path=)\s*(/\S+\.log)", message)
    try:
        lines = Path(found[1]).read_text(errors="replace").splitlines() if found else []
    except OSError:
        return ""
    errors = [line.split(": ", 1)[-1].strip() for line in lines if "Error (" in line and "RLIMIT_NOFILE" not in line]
    return f" (CRIU: {'; '.join(errors[-3:])[:400]})" if errors else ""


def create(container, name: str) -> None:
    """Checkpoint the container's processes as `name`, leaving them running."""
    reply = docker_client().api.post(
        _url(f"/containers/{container.id}/checkpoints"), json={"CheckpointID": name, "Exit": False}
    )
    _check(reply, f"checkpoint of {container.name}")


def folder(container_id: str, name: str) -> Path:
    """Where dockerd keeps a container's checkpoint `name` (on this, its daemon's, host)."""
    root = docker_client().info()["DockerRootDir"]
    return Path(root) / "containers" / container_id / "checkpoints" / name


def restore(source_id: str, container, name: str, held=()) -> None:
    """Start a created container from the source's checkpoint `name`, copied into its own
    checkpoints folder (removed again whatever happens: the restored processes do not need it).
    `held`: container paths of small files in a bind-mounted host folder that the processes
    hold open (tp-session's lock file in CTL_DIR), copied from the source's folder first."""
    target = folder(container.id, name)
    try:
        source = docker_client().containers.get(source_id)
        for path in held:
            _copy_held(_host_path(source, path), _host_path(container, path))
        shutil.copytree(folder(source_id, name), target)
        # dockerd stores the folder in containerd's content store for the restore and deletes it
        # after: two children restored at once from identical folders collide on the one
        # digest ("already exists"). A file CRIU never reads makes each child's copy its own.
        (target / "termpool-restored-as").write_text(container.id)
        reply = docker_client().api.post(_url(f"/containers/{container.id}/start"), params={"checkpoint": name})
        _check(reply, f"restore of {container.name}")
    finally:
        shutil.rmtree(target, ignore_errors=True)


def _host_path(container, path: str) -> Path:
    """The host path of a container path inside one of its bind mounts."""
    for mount in (container.attrs or {}).get("Mounts") or []:
        inside = mount.get("Destination", "")
        if mount.get("Type") == "bind" and path.startswith(inside.rstrip("/") + "/"):
            return Path(mount["Source"]) / path[len(inside) :].lstrip("/")
    raise CheckpointFailed(f"{path} is in no bind mount of {container.name}")


def _copy_held(source: Path, target: Path) -> None:
    """Copy a small regular file; the task can write in the source's folder, so no link is
    followed and no large file is taken (the restore then fails on its size, and the fork
    restarts processes)."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # not there: the restore says what it misses
    with os.fdopen(fd, "rb") as f:
        if stat.S_ISREG(os.fstat(f.fileno()).st_mode) and not target.exists():
            target.write_bytes(f.read(HELD_MAX))


def remove(container_id: str, name: str) -> None:
    """Remove the source's checkpoint folder (the container may be gone already)."""
    shutil.rmtree(folder(container_id, name), ignore_errors=True)


def remove_stale(containers, prefix: str, older_than: float) -> list[str]:
    """Checkpoint folders named `prefix`... of these containers, made more than `older_than`
    seconds ago (a worker killed mid-fork): removed. Returns their paths."""
    gone = []
    for container in containers:
        parent = folder(container.id, "x").parent
        for item in parent.glob(f"{prefix}*") if parent.is_dir() else ():
            if time.time() - item.stat().st_mtime > older_than:
                shutil.rmtree(item, ignore_errors=True)
                gone.append(str(item))
    return gone
