"""The last hour of the pool, per minute, for the pool dashboard (app/pool_view.py): /metrics
holds only totals since each process started, a dashboard wants "failures and latency lately".

  recent:req:<minute>   hash, RECENT_TTL: "<tenant>|<endpoint>|<latency class>" -> requests the
                        facade answered in that minute (app/recent_requests.py, a batch a second)
  recent:err:<minute>   hash, RECENT_TTL: "<tenant>|<code>" -> error replies by code
  recent:fail:<minute>  hash, RECENT_TTL: "<tenant>|<code>" -> failed jobs by failure code
                        (jobs.py's finish script, beside count:failures)

<minute> is whole minutes since the epoch; <tenant> the tenant's name, NO_TENANT for the
operator's requests and runs. A latency class is a step of a geometric scale (CLASS_RATIO),
so a percentile read back is within that ratio of the true one whatever the operation's speed.
"""

from __future__ import annotations

import math
import time

import redis

from poolcore.state import keys

WINDOW_MINUTES = 60
CLASS_RATIO = 1.2  # latency class i holds requests of up to 1 ms * CLASS_RATIO**i
MAX_CLASS = 100  # 1 ms * 1.2**100: about 23 hours, past any request's limit
NO_TENANT = "-"


def latency_class(seconds: float) -> int:
    """The class of a request that took `seconds` (0: a millisecond or less)."""
    ms = seconds * 1000
    if ms <= 1:
        return 0
    return min(MAX_CLASS, math.ceil(math.log(ms) / math.log(CLASS_RATIO)))


def percentile(classes: dict[int, int], q: float) -> float:
    """The q-quantile in milliseconds of requests counted by class, interpolated inside its
    class as Prometheus's histogram_quantile does; 0.0 for no requests."""
    total = sum(classes.values())
    if not total:
        return 0.0
    rank, seen = q * total, 0
    for index in sorted(classes):
        count = classes[index]
        if seen + count >= rank:
            upper = CLASS_RATIO**index
            lower = 0.0 if index == 0 else CLASS_RATIO ** (index - 1)
            return lower + (upper - lower) * (rank - seen) / count
        seen += count
    return CLASS_RATIO ** max(classes)


def minute(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // 60)


def request_field(tenant: str, endpoint: str, seconds: float) -> str:
    """A recent:req hash's field for an answered request."""
    return f"{tenant}|{endpoint}|{latency_class(seconds)}"


def error_field(tenant: str, code: str) -> str:
    """A recent:err hash's field for an error reply."""
    return f"{tenant}|{code}"


class RecentState:
    """Store's rolling record of the last hour."""

    _r: redis.Redis  # Store.__init__ sets it

    def record_request(self, tenant: str, endpoint: str, seconds: float, code: str = "") -> None:
        """One answered request (and its error code, for an error reply): one round trip."""
        now = minute()
        errors = {(now, error_field(tenant, code)): 1} if code else {}
        self.record_requests({(now, request_field(tenant, endpoint, seconds)): 1}, errors)

    def record_requests(self, requests: dict[tuple[int, str], int], errors: dict[tuple[int, str], int]) -> None:
        """Counts of answered requests, {(minute, "tenant|endpoint|latency class"): n}, and of
        error replies, {(minute, "tenant|code"): n}, added in one round trip."""
        pipe = self._r.pipeline(transaction=False)
        for key_of, counts in ((keys.recent_requests_key, requests), (keys.recent_errors_key, errors)):
            for (at, field), n in counts.items():
                pipe.hincrby(key_of(at), field, n)
            for at in {at for at, _ in counts}:
                pipe.expire(key_of(at), keys.RECENT_TTL)
        pipe.execute()

    def recent_activity(self, tenant: str | None = None, now: float | None = None) -> dict:
        """The last WINDOW_MINUTES: per endpoint its requests and latency p50/p95 (ms), error
        replies by code and failed jobs by code; only `tenant`'s own (None: everyone's)."""
        last = minute(now)
        minutes = range(last - WINDOW_MINUTES + 1, last + 1)
        pipe = self._r.pipeline(transaction=False)
        for m in minutes:
            pipe.hgetall(keys.recent_requests_key(m))
            pipe.hgetall(keys.recent_errors_key(m))
            pipe.hgetall(keys.recent_failures_key(m))
        raw = pipe.execute()
        classes: dict[str, dict[int, int]] = {}
        for field, n in _fields(raw[0::3], tenant):
            endpoint, _, index = field.rpartition("|")
            per_class = classes.setdefault(endpoint, {})
            per_class[int(index)] = per_class.get(int(index), 0) + n
        latency = {
            endpoint: {
                "requests": sum(counts.values()),
                "p50_ms": round(percentile(counts, 0.5), 2),
                "p95_ms": round(percentile(counts, 0.95), 2),
            }
            for endpoint, counts in sorted(classes.items())
        }
        return {
            "window_minutes": WINDOW_MINUTES,
            "latency": latency,
            "errors": _summed(_fields(raw[1::3], tenant)),
            "job_failures": _summed(_fields(raw[2::3], tenant)),
        }


def _fields(hashes: list[dict], tenant: str | None):
    """(field without its tenant, count) of every hash, only `tenant`'s when one is named."""
    for counts in hashes:
        for field, n in counts.items():
            owner, _, rest = field.partition("|")
            if tenant is None or owner == tenant:
                yield rest, int(n)


def _summed(pairs) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, n in pairs:
        out[name] = out.get(name, 0) + n
    return dict(sorted(out.items()))
