"""A task's images on this host: built (or pulled) once, and built again when the task changes.

In build mode every image a build makes carries the task's content digest
(environments/image_digest.py); an image whose digest is not the task's now is stale, and is
built again under the image's build lock, so a changed Dockerfile is never served its old image.
In pull mode images are named by the task (TBENCH_DOCKER_PULL_PREFIX, a Harbor task's
docker_image) and pulled when absent.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import docker.errors
import requests
import urllib3

from environments import container_spec, pool_images, task_images
from environments.compose_config import build_env, client_image, client_service, service_images
from environments.docker_client import MAX_OUTPUT, ComposeError, docker_client, run_compose
from environments.image_digest import CONTENT_LABEL, environment_digest
from environments.lifecycle import BUILD_CLIENT_NAME, build_context, compose_files, is_template, load_compose
from environments.pool_images import PRESENT
from poolcore.config import Settings
from poolcore.failures import TaskBuildFailed
from poolcore.task_spec import name_prefix

if TYPE_CHECKING:
    from poolcore.state import OwnedLock, Store


def ensure_image(*args, **kwargs) -> str:
    """ensure_images' agent image: the name runs of the task start from."""
    return ensure_images(*args, **kwargs)[0]


def ensure_images(
    task_name: str,
    task_dir: Path,
    cfg: Settings,
    timeout: float,
    build_lock: Callable[[str], OwnedLock],
    pool: Store | None = None,
    build_slot: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> tuple[str, str]:
    """Have the task's images on this host as the task is now: (the agent's image, PRESENT,
    BUILT or PULLED).

    build_lock(image) is the host's lock on building that image (Store.build_lock): concurrent
    callers on a host wait for one. With the pool's registry (REGISTRY_URL) a host pulls what
    another built; `pool` (the state store: its pool-wide build lock, the registry's last uses)
    makes one host of the pool build a new environment while the others wait, then pull it
    (environments/pool_images.py). `build_slot`, when given, is held while a build runs (not
    while the images are found present or pulled): a tenant's build quota (tasks/build_quota.py)."""
    compose = load_compose(task_name, task_dir, cfg, timeout)
    client_service(compose, BUILD_CLIENT_NAME, task_dir)  # a task without one agent's service: before any build
    image = client_image(task_name, cfg, task_dir)
    if cfg.image_source == "pull":
        if image_current(image, None):
            return image, PRESENT
        return image, pool_images.fetch_named(cfg, image, timeout, pool)
    template, needed, digest = _wanted(task_name, task_dir, compose, cfg)
    if all(image_current(i, digest) for i in needed):
        return image, PRESENT
    lock = build_lock(image)  # expires within seconds of its holder's death
    if not lock.acquire(wait=timeout):
        raise TimeoutError(f"waited {timeout:g} s for another build of {image} (held by {lock.owner()})")
    with lock:
        if all(image_current(i, digest) for i in needed):  # built by whoever held the lock
            return image, PRESENT
        labels = {**task_images.build_labels(cfg.host_id, image), CONTENT_LABEL: digest}
        if template:
            build = functools.partial(_build_with_sdk, task_dir, compose, image, labels, cfg, timeout)
        else:
            build = functools.partial(_build_with_compose, task_name, task_dir, compose, labels, cfg, timeout)
        if build_slot is not None:
            build = functools.partial(_held, build_slot, build)
        by_service = built_by_service(task_name, compose, cfg, template)
        return image, pool_images.build_or_pull(cfg, digest, by_service, build, timeout, pool)


def _held(slot: Callable[[], contextlib.AbstractContextManager], build: Callable[[], None]) -> None:
    with slot():
        build()


def images_current(task_name: str, task_dir: Path, cfg: Settings, timeout: float) -> bool:
    """Whether this host has the task's images as the task is now (pull mode: present at all)."""
    compose = load_compose(task_name, task_dir, cfg, timeout)
    image = client_image(task_name, cfg, task_dir)
    if cfg.image_source == "pull":
        return image_current(image, None)
    _, needed, digest = _wanted(task_name, task_dir, compose, cfg)
    return all(image_current(i, digest) for i in needed)


def _wanted(task_name: str, task_dir: Path, compose: dict, cfg: Settings) -> tuple[bool, list[str], str]:
    """What build mode wants on the host: (whether the SDK builds the one service, the images a
    build makes, the environment's content digest)."""
    template = is_template(compose, cfg, task_dir, task_name)
    needed = [client_image(task_name, cfg, task_dir)] if template else built_images(task_name, compose, cfg)
    return template, needed, environment_digest(compose)


def built_by_service(task_name: str, compose: dict, cfg: Settings, template: bool) -> dict[str, str]:
    """The image each service of the task builds, by service name (the agent's included)."""
    if template:
        return {next(iter(compose["services"])): client_image(task_name, cfg)}
    generated = service_images(task_name, compose)
    return {
        name: generated.get(name) or svc.get("image", "")
        for name, svc in compose["services"].items()
        if "build" in svc and (generated.get(name) or svc.get("image"))
    }


def built_images(task_name: str, compose: dict, cfg: Settings) -> list[str]:
    """Every image a compose build produces (client first), as compose resolved their names."""
    images = [client_image(task_name, cfg), *built_by_service(task_name, compose, cfg, False).values()]
    return list(dict.fromkeys(images))  # build mode: task_dir changes nothing of the client's name


def image_current(image: str, digest: str | None) -> bool:
    """Whether `image` is on this host and was built from `digest` (None: any image will do).
    An image built before digests were recorded has none: it is built again, once."""
    try:
        found = docker_client().images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return digest is None or (found.labels or {}).get(CONTENT_LABEL) == digest


def _build_with_sdk(task_dir: Path, compose: dict, image: str, labels: dict, cfg: Settings, timeout: float) -> None:
    [service] = compose["services"].values()  # the fast path's one service
    build = service.get("build") or {}
    dockerfile = build.get("dockerfile", "Dockerfile")
    deadline = time.monotonic() + timeout
    log = []
    stream = docker_client().api.build(
        path=str(build_context(task_dir)),
        dockerfile=dockerfile,
        tag=image,
        rm=True,
        forcerm=True,
        buildargs=dict(cfg.proxy_env),
        labels=labels,
        decode=True,
        timeout=timeout,
    )
    try:
        for chunk in stream:
            log.append(chunk.get("stream") or chunk.get("status") or "")
            if "error" in chunk:
                tail = "".join(log)[-MAX_OUTPUT:]
                where = build_context(task_dir) / dockerfile
                raise TaskBuildFailed(
                    f"building {image} from {where} failed: {chunk['error'].strip()}\n{tail}", output=tail
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"building {image} did not finish within {timeout:g} s")
    except (urllib3.exceptions.ReadTimeoutError, requests.exceptions.ReadTimeout):
        # A build step silent for the whole limit (the stream's read timeout is the limit).
        raise TimeoutError(f"building {image} did not finish within {timeout:g} s") from None
    finally:
        # Closing the stream drops the connection, which is what stops the daemon's build; left to
        # the garbage collector (a traceback keeps it alive) the build would run on past its limit.
        stream.close()


def _build_with_compose(
    task_name: str, task_dir: Path, compose: dict, labels: dict, cfg: Settings, timeout: float
) -> None:
    with tempfile.TemporaryDirectory(prefix="termpool-build-") as tmp:
        override = container_spec.run_override(compose, task_name, labels, "", [], cfg, 0)
        files = compose_files(task_dir, cfg, override, Path(tmp))
        try:
            run_compose(
                ["-p", name_prefix(task_name).lower(), *files, "build"], build_env(task_name, cfg), timeout, task_dir
            )
        except ComposeError as exc:
            raise TaskBuildFailed(
                f"building the images of {files[1]} failed: {exc.stderr_tail}", output=exc.stderr_tail
            ) from None
