"""The asyncio client: AsyncPool, and the AsyncRun, AsyncLease and AsyncJob it gives."""

from __future__ import annotations

import httpx

from termpool.client.drivers import awaitable
from termpool.client.ops import JobOps, LeaseOps, RunOps
from termpool.client.pool_ops import DEFAULT_URL, PoolOps


@awaitable
class AsyncJob(JobOps):
    """A submitted operation: await wait() for its result, record() for its state."""


@awaitable
class AsyncRun(RunOps):
    """One leased task environment; `async with` closes it on exit."""


@awaitable
class AsyncLease(LeaseOps):
    """One lease of the blocking pool API (AsyncPool.allocate); `async with` closes it on exit."""


@awaitable
class AsyncPool(PoolOps):
    """A termpool service for asyncio: many episodes from one process and one event loop.
    Same methods as Pool, as coroutines; `async with AsyncPool(url) as pool:`."""

    _run_class = AsyncRun
    _job_class = AsyncJob
    _lease_class = AsyncLease

    def __init__(self, url: str = DEFAULT_URL, *, max_connections: int = 100, **options):
        super().__init__(url, **options)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(limits=limits, **self._http_options())
