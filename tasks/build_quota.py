"""A tenant's image builds in flight (docs/tenants.md, "Quotas"): counted where a build really
starts, on the worker, because only there is it known that a start builds (its images may be
present, or pulled from the pool's registry).

A tenant's run whose start must build while the tenant has its max_builds in flight fails at
once with TENANT_QUOTA_EXCEEDED (retryable: reset again later) instead of waiting in a build
process: a waiting build would hold one of the host's few build processes and so take builds
from the other tenants, which is what the quota is there to prevent.
"""

from __future__ import annotations

import contextlib
import functools

from poolcore.failures import TenantQuotaExceeded
from poolcore.state import QuotaRefused, Store

LEASE_MARGIN = 120.0  # seconds past the build's limit: the worker's hard time limit is 60 past it


def slot(store: Store, run: dict, job_id: str, limit: float):
    """What task_builds.ensure_images holds while it builds for this run: None for the
    operator's runs (no tenant, no quota)."""
    tenant = run.get("tenant")
    if not tenant:
        return None
    return functools.partial(_lease, store, tenant, job_id, store.tenant_max_builds(tenant), limit + LEASE_MARGIN)


@contextlib.contextmanager
def _lease(store: Store, tenant: str, job_id: str, max_builds: int | None, lease: float):
    """A build lease, given back however the build ends; a worker that dies mid-build leaves
    it to lapse (the same job sent again after a lost worker takes the same lease)."""
    try:
        store.take_build(tenant, job_id, max_builds, lease)
    except QuotaRefused as refused:
        raise TenantQuotaExceeded(
            f"tenant {tenant!r} has {refused.used} image builds in flight, its max_builds "
            f"({refused.limit}): this start needs a build; reset again when one has finished"
        ) from None
    try:
        yield
    finally:
        store.give_build(tenant, job_id)
