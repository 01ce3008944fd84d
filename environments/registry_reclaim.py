"""The registry's bound: images of the pool that no host has pushed or pulled for
REGISTRY_RETENTION_DAYS are deleted, then the embedded registry's storage is collected.

Last use is kept in Redis (Store.registry_used, one score per tag, set by each
push and pull). A tag found with no record (pushed before tracking, or by hand) starts its clock
at the first reclaim that sees it, so nothing is deleted on sight. Only the pool's namespace
(termpool/) is looked at. A manifest is deleted only when every tag naming it is stale: a tag
in use keeps its digest. `flask --app app registry gc` runs this (cli/registry.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from environments.registry import NAMESPACE, Registry

if TYPE_CHECKING:
    from poolcore.state import Store

log = logging.getLogger(__name__)
DAY = 86400.0


@dataclass
class Reclaimed:
    kept: int = 0  # tags used within the retention (or first seen now)
    deleted: list[str] = field(default_factory=list)  # "repo:tag" whose manifests were deleted
    failed: list[str] = field(default_factory=list)  # deletes the registry refused


def reclaim(registry: Registry, usage: Store, now: float | None = None, dry_run: bool = False) -> Reclaimed:
    """Delete the manifests of the pool's tags unused for the retention; a retention of 0 keeps
    everything. Raises RegistryUnavailable when the registry cannot be listed."""
    now = time.time() if now is None else now
    result = Reclaimed()
    if registry.cfg.retention_days <= 0:
        return result
    cutoff = now - registry.cfg.retention_days * DAY
    for repo in registry.repositories():
        if repo.startswith(NAMESPACE + "/"):
            _reclaim_repository(registry, usage, repo, now, cutoff, dry_run, result)
    return result


def _reclaim_repository(registry, usage, repo, now, cutoff, dry_run, result) -> None:
    by_digest: dict[str, list[tuple[str, bool]]] = {}  # digest -> [(tag, stale)]
    for tag in registry.tags(repo):
        digest = registry.digest(f"{registry.address}/{repo}:{tag}")
        if digest is not None:
            by_digest.setdefault(digest, []).append((tag, _stale(usage, f"{repo}:{tag}", now, cutoff, dry_run)))
    for digest, tags in by_digest.items():
        if not all(stale for _, stale in tags):
            result.kept += len(tags)
            continue
        members = [f"{repo}:{tag}" for tag, _ in tags]
        if dry_run:
            result.deleted += members
            continue
        try:
            registry.delete(repo, digest)
        except OSError as error:
            log.warning("%s", error)
            result.failed += members
            continue
        usage.registry_forget(members)
        result.deleted += members


def _stale(usage: Store, member: str, now: float, cutoff: float, dry_run: bool) -> bool:
    last = usage.registry_last_used(member)
    if last is None:  # never seen: its clock starts now (a dry run only looks)
        if not dry_run:
            usage.registry_first_seen(member, now)
        return False
    return last < cutoff
