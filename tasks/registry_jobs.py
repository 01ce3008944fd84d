"""The pool registry's storage kept bounded: beat sends pool.reclaim_registry every
RECLAIM_SECONDS; it deletes the manifests of the pool's images no host has pushed or pulled for
REGISTRY_RETENTION_DAYS (environments/registry_reclaim.py), then, on the machine whose disk holds
the embedded registry's storage, collects the blobs nothing references any more. The same as
`flask --app app registry gc`, which an operator may run at any time."""

from __future__ import annotations

import logging

from celery import shared_task

from environments import registry_server
from environments.pool_images import pool_registry
from environments.registry_reclaim import reclaim
from poolcore.config import settings
from tasks.runtime import store

log = logging.getLogger(__name__)

RECLAIM_SECONDS = 6 * 3600.0  # a tag is kept REGISTRY_RETENTION_DAYS, give or take this


@shared_task(name="pool.reclaim_registry", bind=True)
def reclaim_registry(self):
    """What was deleted ("<repository>:<tag>"); nothing when the registry is off or away."""
    cfg = settings()
    registry = pool_registry(cfg, store())
    if registry is None or not registry.reachable():
        return []
    done = reclaim(registry, store())
    if done.deleted:
        log.warning(
            "registry %s: deleted %d images unused for %g days",
            registry.address,
            len(done.deleted),
            cfg.registry.retention_days,
        )
        log.info("registry %s: %s", registry.address, registry_server.garbage_collect(cfg.registry))
    if done.failed:
        log.warning("registry %s: %d deletes refused: %s", registry.address, len(done.failed), ", ".join(done.failed))
    return done.deleted
