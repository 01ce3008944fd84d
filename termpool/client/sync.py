"""The blocking client: Pool, and the Run, Lease and Job it gives."""

from __future__ import annotations

import httpx

from termpool.client.drivers import blocking
from termpool.client.ops import JobOps, LeaseOps, RunOps
from termpool.client.pool_ops import DEFAULT_URL, PoolOps


@blocking
class Job(JobOps):
    """A submitted operation: wait() for its result, record() for its state."""


@blocking
class Run(RunOps):
    """One leased task environment. A context manager: closed (released) on exit."""


@blocking
class Lease(LeaseOps):
    """One lease of the blocking pool API (Pool.allocate). A context manager: closed on exit."""


@blocking
class Pool(PoolOps):
    """A termpool service, driven with blocking calls (thread-safe: httpx.Client is)."""

    _run_class = Run
    _job_class = Job
    _lease_class = Lease

    def __init__(self, url: str = DEFAULT_URL, **options):
        super().__init__(url, **options)
        self._http = httpx.Client(**self._http_options())

    __init__.__doc__ = PoolOps.__init__.__doc__
