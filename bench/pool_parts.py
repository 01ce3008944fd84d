"""The parts bench/pool_builds.py measures with: cold copies of the datasets, a private registry,
each daemon's image disk, and the removal of everything a run made.

A copy of a task gets the run's marker (`RUN echo <marker> <context> > /.termpool-bench`) right
after the first FROM of each of its Dockerfiles, so its content digest is new to every registry
and host (cold) and no build step after it finds a layer cached by an earlier run. <context> is
a hash of the Dockerfile's folder as it was: tasks whose environments are identical stay
identical (the pool should build them once: the issue's target counts distinct environments,
not tasks), and different ones share no cached layer on a host (each pays its own build).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import time
from pathlib import Path

import docker
import docker.errors

from devstack import FIXTURES, ROOT, free_port
from environments import registry_server
from environments.image_digest import CONTENT_LABEL
from poolcore.config import load_registry

EXAMPLES = ROOT / "examples" / "tasks"
HARBOR = FIXTURES.parent / "harbor"
BASE_IMAGE = "termpool-test-base:bookworm"
BASE_ALIASES = ("termpool-base:bookworm",)  # the examples build FROM this name of the same image
# Harbor fixtures that cannot be part of a build benchmark here, and why.
SKIPPED = {
    "harbor-prebuilt": "names an image (docker_image termpool-harbor-prebuilt:fixture) that no registry here holds",
    "harbor-slow-build": "fails to build by design (RUN sleep 120 && false, build_timeout_sec 3)",
    "harbor-multi-step": "a multi-step task (steps/): termpool answers TaskUnsupported at reset",
}
QUICK_TASKS = ("quiz", "text-stats", "harbor-hello", "harbor-env", "harbor-workdir")
FROM_LINE = re.compile(r"^FROM\s.*$", re.MULTILINE)


def source_tasks(quick: bool) -> list[Path]:
    """The example tasks and the Harbor fixtures that build (SKIPPED apart); a few in quick mode."""
    found = sorted(EXAMPLES.iterdir()) + [p for p in sorted(HARBOR.iterdir()) if p.name not in SKIPPED]
    found = [p for p in found if p.is_dir()]
    return [p for p in found if p.name in QUICK_TASKS] if quick else found


def copy_dataset(tasks: list[Path], root: Path, suffix: str, marker: str, sleep: float = 0) -> list[str]:
    """Copies of `tasks` in `root` named <task>-<suffix> (image names of this run only), each
    Dockerfile marked; their names, which are also their task paths under root. sleep: seconds
    the marker's step also waits, standing for a real build's download steps (no CPU)."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for task in tasks:
        name = f"{task.name}-{suffix}"
        shutil.copytree(task, root / name, symlinks=True)
        for dockerfile in (root / name).rglob("Dockerfile"):
            text = dockerfile.read_text()
            first = FROM_LINE.search(text)
            token = folder_hash(dockerfile.parent)
            mark = f"\nRUN echo {marker} {token} > /.termpool-bench" + (f" && sleep {sleep:g}" if sleep else "")
            dockerfile.write_text(text[: first.end()] + mark + text[first.end() :])
        names.append(name)
    return names


def folder_hash(folder: Path) -> str:
    """A short hash of a folder's files (paths and contents), before any is marked."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class PrivateRegistry:
    """Debian's docker-registry on a free loopback port with an empty storage folder of its own
    (cold), started with termpool's own code and stopped by its pid. Both daemons of this machine
    share its network namespace, so 127.0.0.1 reaches it (Docker allows plain HTTP there)."""

    def __init__(self, data_dir: Path):
        port = free_port()
        self.cfg = load_registry({"REGISTRY_URL": f"127.0.0.1:{port}", "REGISTRY_DATA_DIR": str(data_dir)})
        self.address = self.cfg.address
        self.pid = 0

    def start(self) -> PrivateRegistry:
        registry_server.ensure_running(self.cfg)
        self.pid = int((self.cfg.data_dir / "registry.pid").read_text())
        return self

    def stored_bytes(self) -> int:
        """The storage's bytes (blobs and manifests; its log and pid file apart)."""
        return tree_bytes(self.cfg.data_dir / "docker")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 20 s. The registry is this process's child (ensure_running
        started it from here), so its pid is not reused before it is reaped here."""
        if not self.pid:
            return
        pid, self.pid = self.pid, 0
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
                time.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def load_base(daemon) -> None:
    """The test base image in a second daemon, under both of its names."""
    daemon.load_image(BASE_IMAGE)
    client = daemon.client()
    for alias in BASE_ALIASES:
        repo, tag = alias.split(":")
        client.images.get(BASE_IMAGE).tag(repo, tag)
    client.close()


def bench_images(client: docker.DockerClient, marks: tuple[str, ...]) -> dict[str, int]:
    """The images of this run on a daemon, id -> size: any tag naming one of `marks` (the run's
    suffixes, the private registry's address). From the listing alone: images.list() inspects
    each image after listing, and on the shared daemon another user's image removed between the
    two fails it."""
    return {
        image["Id"]: image["Size"]
        for image in client.api.images()
        if any(m in tag for tag in image.get("RepoTags") or () for m in marks)
    }


def image_disk(client: docker.DockerClient, marks: tuple[str, ...]) -> dict:
    """A daemon's image disk: all its layers (`docker system df`'s LayersSize; on the machine's
    shared daemon other users' images come and go too) and this run's images above the base
    image (each distinct image's size less the base's: the layers the run added)."""
    base = client.images.get(BASE_IMAGE).attrs["Size"]
    mine = bench_images(client, marks)
    return {
        "layers_mb": round(client.df()["LayersSize"] / 1e6, 1),
        "bench_images": len(mine),
        "bench_above_base_kb": round(sum(size - base for size in mine.values()) / 1e3, 1),
    }


def client_ids(client: docker.DockerClient, image_names: dict[str, str]) -> dict[str, dict]:
    """task -> {id, content} of its agent's image on this daemon (tasks without one left out)."""
    found = {}
    for task, name in image_names.items():
        with contextlib.suppress(docker.errors.ImageNotFound):
            image = client.images.get(name)
            found[task] = {"id": image.id, "content": (image.labels or {}).get(CONTENT_LABEL, "")}
    return found


def wait_no_containers(client: docker.DockerClient, host: str, timeout: float = 90) -> bool:
    """Wait until the host's runs are torn down (WARM_POOL_SIZE=0: no spare stays), so the next
    reset is measured alone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not client.containers.list(all=True, filters={"label": f"termpool.host={host}"}):
            return True
        time.sleep(0.3)
    return False


def remove_run_objects(client: docker.DockerClient, hosts: list[str], marks: tuple[str, ...]) -> list[str]:
    """Every container of the run's hosts and every image of the run on a daemon (by id, force:
    all its tags go); what could not be removed."""
    left = []
    for host in hosts:
        for container in client.containers.list(all=True, filters={"label": f"termpool.host={host}"}):
            try:
                container.remove(force=True, v=True)
            except docker.errors.DockerException as exc:
                left.append(f"container {container.name}: {exc}")
    for image in bench_images(client, marks):
        try:
            client.images.remove(image, force=True)
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.DockerException as exc:
            left.append(f"image {image}: {exc}")
    return left
