"""One build per pool: a task environment new to a host is pulled from the pool's registry when
another host built it, and built (then pushed) by one host of the pool at a time when none has.

An environment's images are named in the registry by content, not by task:
<registry>/termpool/env-<service>:<content digest> (environments/image_digest.py), so a task that
changed is a new name and two tasks with one environment share theirs. A pulled image is taken
only if its content label is the digest asked for, and the registry's manifest digest is the one
pulled (Registry.pull); anything else is discarded and built here.

The registry never fails a run that can be built here: when it is down or refuses, the host
builds on its own (and says so in its log); a push that fails is logged and the run goes on,
and the image is pushed by a later build of it on any host (push_missing, from the reconcile).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import docker.errors

from environments.docker_client import docker_client
from environments.image_digest import CONTENT_LABEL
from environments.registry import Registry, RegistryUnavailable, split_ref
from poolcore.config import RegistrySettings, Settings
from poolcore.failures import TaskBuildFailed, TaskImageNotFound

if TYPE_CHECKING:
    from poolcore.state import Store

log = logging.getLogger(__name__)

PRESENT, BUILT, PULLED = "present", "built", "pulled"  # how a host came to have a task's images


def pool_registry(cfg: Settings, pool: Store | None) -> Registry | None:
    """The pool's registry, recording last uses in `pool`; None when REGISTRY_URL is off."""
    return registry_of(cfg.registry, pool) if cfg.registry.enabled else None


@functools.lru_cache(maxsize=4)
def registry_of(settings: RegistrySettings, pool: Store | None) -> Registry:
    return Registry(settings, pool)  # one HTTP session per registry and process


def remote_refs(registry: Registry, digest: str, by_service: dict[str, str]) -> dict[str, str]:
    """Each service's image name in the registry, by content."""
    return {service: registry.remote_ref(f"env-{service}:{digest}") for service in by_service}


def build_or_pull(
    cfg: Settings,
    digest: str,
    by_service: dict[str, str],
    build: Callable[[], None],
    timeout: float,
    pool: Store | None,
) -> str:
    """Have the images of `by_service` ({service: local name}) of environment `digest` on this
    host: PULLED from the pool's registry, or BUILT by `build()` here (then pushed). `pool`:
    the state store (the pool-wide build lock); None builds without waiting for other hosts."""
    registry = pool_registry(cfg, pool)
    if registry is None or not digest:
        build()
        return BUILT
    refs = remote_refs(registry, digest, by_service)
    try:
        pulled = pull_all(registry, refs, by_service, digest)
    except RegistryUnavailable as exc:
        log.warning("%s; building %s on this host", exc, ", ".join(by_service.values()))
        _note(pool, cfg, "unreachable", str(exc))
        build()
        _later(pool, cfg, {by_service[service]: ref for service, ref in refs.items()})
        return BUILT
    _note(pool, cfg, "reachable")
    if pulled:
        return PULLED
    if pool is None:  # a caller with no state store (a test) builds and pushes on its own
        return _build_and_push(registry, refs, by_service, build, cfg, pool)
    lock = pool.pool_build_lock(digest)
    if not lock.acquire(wait=timeout):
        raise TimeoutError(f"waited {timeout:g} s for another host's build of {digest[:12]} (held by {lock.owner()})")
    with lock:
        if _quietly(pull_all, registry, refs, by_service, digest):  # built by the host that held the lock
            return PULLED
        return _build_and_push(registry, refs, by_service, build, cfg, pool)


def _build_and_push(registry: Registry, refs: dict, by_service: dict, build, cfg: Settings, pool) -> str:
    """Build, then push each image; one the registry did not take is pushed later (upkeep)."""
    build()
    failed = {}
    for service, local in by_service.items():
        if failed or registry.push(docker_client(), local, refs[service]) is None:
            failed[local] = refs[service]
    _later(pool, cfg, failed)
    return BUILT


def _note(pool: Store | None, cfg: Settings, state: str, detail: str = "") -> None:
    """How this host found the registry, for /status (never fails a build: Redis may be away)."""
    if pool is not None:
        try:
            pool.note_registry(cfg.host_id, state, detail)
        except Exception as exc:
            log.warning("the registry's state on this host was not recorded: %s", exc)


def _later(pool: Store | None, cfg: Settings, images: dict[str, str]) -> None:
    if pool is not None and images:
        pool.push_pending(cfg.host_id, images)


def upkeep(cfg: Settings, pool: Store, host: str) -> list[str]:
    """The reconcile's look at the registry: note whether it answers (/status per host) and,
    when it does, push what this host could not push before; the names pushed."""
    registry = pool_registry(cfg, pool)
    if registry is None:
        pool.note_registry(host, "off")
        return []
    if not registry.reachable():
        pool.note_registry(host, "unreachable", f"registry {registry.address} did not answer GET /v2/")
        return []
    pool.note_registry(host, "reachable")
    pushed = []
    for local, ref in pool.pending_pushes(host).items():
        if not _still_that_image(local, ref):
            pool.push_done(host, local)  # gone, or rebuilt as another environment since
        elif registry.push(docker_client(), local, ref) is not None:
            pool.push_done(host, local)
            pushed.append(ref)
    return pushed  # one refused again stays for the next reconcile


def _still_that_image(local: str, ref: str) -> bool:
    """Whether `local` is still the image `ref` names (its content digest is ref's tag): a task
    rebuilt since is another environment, pushed under its own name by its own build."""
    try:
        labels = docker_client().images.get(local).labels or {}
    except docker.errors.ImageNotFound:
        return False
    return labels.get(CONTENT_LABEL) == split_ref(ref)[1]


def _quietly(pull, registry: Registry, *args) -> bool:
    """A pull from the registry; False (logged) when the registry cannot say: build or fetch here."""
    try:
        return pull(registry, *args)
    except RegistryUnavailable as exc:
        log.warning("%s; going on without the pool's registry", exc)
        return False


def pull_all(registry: Registry, refs: dict[str, str], by_service: dict[str, str], digest: str) -> bool:
    """Pull every image of the environment, each tagged with its local name; False when the
    registry lacks one or one pulled is not what was asked for (then discarded). Raises
    RegistryUnavailable when the registry cannot say."""
    expected = {service: registry.digest(ref) for service, ref in refs.items()}
    if not all(expected.values()):
        return False
    client = docker_client()
    for service, ref in refs.items():
        image = registry.pull(client, ref, expected[service])
        if image is None:
            return False
        if (image.labels or {}).get(CONTENT_LABEL) != digest:
            log.warning(
                "registry %s: %s carries content %s, not %s: discarded",
                registry.address,
                ref,
                (image.labels or {}).get(CONTENT_LABEL),
                digest,
            )
            registry.untag(client, ref)
            return False
        image.tag(*split_ref(by_service[service]))
    return True


# ---- images named by a task (pull mode, a Harbor task's docker_image) ---------------------------
def fetch_named(cfg: Settings, image: str, timeout: float, pool: Store | None) -> str:
    """Have an image the task names on this host: PULLED from the pool's registry, which holds
    a copy of it once any host fetched it from its own registry (one fetch for the whole pool);
    else from its own registry (then copied into the pool's, one host at a time)."""
    registry = pool_registry(cfg, pool)
    if registry is None:
        _pull_upstream(image)
        return PULLED
    mirror = registry.remote_ref(image)
    try:
        if _pull_mirror(registry, mirror, image):
            return PULLED
    except RegistryUnavailable as exc:
        log.warning("%s; pulling %s from its own registry", exc, image)
        _pull_upstream(image)
        return PULLED
    lock = pool.pool_build_lock(f"named:{image}") if pool else None
    if lock is not None and not lock.acquire(wait=timeout):
        raise TimeoutError(f"waited {timeout:g} s for another host's fetch of {image} (held by {lock.owner()})")
    try:
        if lock is not None and _quietly(_pull_mirror, registry, mirror, image):
            return PULLED
        _pull_upstream(image)
        registry.push(docker_client(), image, mirror)  # a failure is logged: the next host fetches it again
    finally:
        if lock is not None:
            lock.release()
    return PULLED


def _pull_mirror(registry: Registry, mirror: str, image: str) -> bool:
    expected = registry.digest(mirror)
    if not expected:
        return False
    return registry.pull(docker_client(), mirror, expected, tag_as=image) is not None


def _pull_upstream(image: str) -> None:
    """Pull from the image's own registry: TaskImageNotFound when no registry has it."""
    try:
        docker_client().images.pull(image)
    except docker.errors.NotFound as exc:
        raise TaskImageNotFound(
            f"image {image} exists nowhere: its registry answered {exc.explanation or exc}"
        ) from None
    except docker.errors.APIError as exc:
        if "not found" in str(exc.explanation or exc).lower() or "manifest unknown" in str(exc).lower():
            raise TaskImageNotFound(f"image {image} exists nowhere: {exc.explanation or exc}") from None
        raise TaskBuildFailed(
            f"image {image} is not on this host and could not be pulled: {exc.explanation or exc}"
        ) from None
