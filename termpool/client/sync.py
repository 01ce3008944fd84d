"""The blocking client: Pool, and the Run, Lease and Job it gives."""

from __future__ import annotations

import httpx

from termpool.client.drivers import blocking
from termpool.client.ops import _JobOps, _LeaseOps, _RunOps
from termpool.client.pool_ops import DEFAULT_URL, _PoolOps


@blocking
class Job(_JobOps):
    """A submitted operation: wait() for its result, record() for its state."""


@blocking
class Run(_RunOps):
    """One leased task environment. A context manager: closed (released) on exit."""


@blocking
class Lease(_LeaseOps):
    """One lease of the blocking pool API (Pool.allocate). A context manager: closed on exit."""


@blocking
class Pool(_PoolOps):
    """A termpool service, driven with blocking calls (thread-safe: httpx.Client is)."""

    _run_class = Run
    _job_class = Job
    _lease_class = Lease

    def __init__(self, url: str = DEFAULT_URL, **options):
        super().__init__(url, **options)
        self._http = httpx.Client(**self._http_options())

    __init__.__doc__ = _PoolOps.__init__.__doc__
