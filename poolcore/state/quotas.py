"""A tenant's quotas beside its live runs (docs/tenants.md, "Quotas"): image builds in flight
and the bytes of its uploaded tasks, each checked and taken in one Lua step so racing requests
cannot overshoot.

  tenant:<t>:builds      zset: job id -> when its lease lapses (ms). A build takes a lease
                         before it starts and gives it back when it ends; a worker that dies
                         mid-build cannot, so every count first drops the leases of jobs that
                         have ended (a lost build failed WORKER_LOST) or are gone, and those
                         past the build's own time limit.
  tenant:<t>:uploads     hash: blob id -> unpacked bytes. An entry counts while the tenant is
                         among the blob's holders (blob:<id>:holders, which lapses with the
                         blob); every count first drops the entries whose holding lapsed.
  tenant-build-limits    hash: tenant -> max_builds. Workers have no tenants file; the facades
                         write what theirs says when they start.
"""

from __future__ import annotations

import time

import redis

from poolcore.state import keys

# KEYS[1] the builds zset; ARGV: key prefix, job id ('' to count only), max_builds (-1: none),
# now (ms), lease end (ms). Leases that lapsed, or whose job has ended or is gone, are dropped
# first. Answers {1, in flight} when taken (a job holding one keeps it), {0, in flight} when not.
_TAKE_BUILD = """
local p, job, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[4])
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local state = redis.call('HGET', p .. 'job:' .. id, 'state')
  if not state or state == 'succeeded' or state == 'failed' then redis.call('ZREM', KEYS[1], id) end
end
local n = redis.call('ZCARD', KEYS[1])
if job == '' then return {0, n} end
if not redis.call('ZSCORE', KEYS[1], job) and limit >= 0 and n >= limit then return {0, n} end
redis.call('ZADD', KEYS[1], ARGV[5], job)
return {1, redis.call('ZCARD', KEYS[1])}
"""

# KEYS[1] the uploads hash; ARGV: tenant, key prefix, blob id ('' to count only), bytes,
# max bytes (-1: none), TTL (ms). Answers {status, bytes held}: 1 newly held, 0 held already
# (its holding starts again), -1 refused (nothing recorded).
_HOLD_UPLOAD = """
local tenant, p, blob = ARGV[1], ARGV[2], ARGV[3]
local function holders(id) return p .. 'blob:' .. id .. ':holders' end
local total, sizes = 0, redis.call('HGETALL', KEYS[1])
for i = 1, #sizes, 2 do
  if redis.call('SISMEMBER', holders(sizes[i]), tenant) == 1 then
    total = total + tonumber(sizes[i + 1])
  else
    redis.call('HDEL', KEYS[1], sizes[i])
  end
end
if blob == '' then return {0, total} end
local size, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('HEXISTS', KEYS[1], blob) == 1 then
  redis.call('PEXPIRE', holders(blob), ARGV[6])
  return {0, total}
end
if limit >= 0 and total + size > limit then return {-1, total} end
redis.call('HSET', KEYS[1], blob, size)
redis.call('SADD', holders(blob), tenant)
redis.call('PEXPIRE', holders(blob), ARGV[6])
return {1, total + size}
"""


class QuotaRefused(Exception):
    """A tenant is at a quota: `used` of `limit` (the unit is the quota's)."""

    def __init__(self, used: int, limit: int):
        super().__init__(f"{used} of {limit}")
        self.used, self.limit = used, limit


class QuotasState:
    _r: redis.Redis

    def _script(self, name: str, text: str):
        script = self.__dict__.get(name)
        if script is None:
            script = self.__dict__[name] = self._r.register_script(text)
        return script

    # ---- builds in flight --------------------------------------------------------------------
    def publish_build_limits(self, limits: dict[str, int]) -> None:
        """The tenants file's max_builds, for the workers: replaces what was there."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(keys.TENANT_BUILD_LIMITS)
        if limits:
            pipe.hset(keys.TENANT_BUILD_LIMITS, mapping=limits)
        pipe.execute()

    def tenant_max_builds(self, tenant: str) -> int | None:
        value = self._r.hget(keys.TENANT_BUILD_LIMITS, tenant)
        return None if value is None else int(value)

    def take_build(self, tenant: str, job_id: str, limit: int | None, lease: float) -> int:
        """A build lease for the job, for `lease` seconds at most: the builds in flight with it;
        QuotaRefused when the tenant has `limit` in flight already."""
        taken, in_flight = self._builds(tenant, job_id, limit, lease)
        if not taken:
            raise QuotaRefused(in_flight, int(limit or 0))
        return in_flight

    def give_build(self, tenant: str, job_id: str) -> None:
        self._r.zrem(keys.tenant_builds_key(tenant), job_id)

    def builds_in_flight(self, tenant: str) -> int:
        return self._builds(tenant, "", None, 0)[1]

    def _builds(self, tenant: str, job_id: str, limit: int | None, lease: float) -> tuple[int, int]:
        now = int(time.time() * 1000)
        args = [keys.PREFIX, job_id, -1 if limit is None else limit, now, now + int(lease * 1000)]
        taken, in_flight = self._script("_take_build", _TAKE_BUILD)(keys=[keys.tenant_builds_key(tenant)], args=args)
        return int(taken), int(in_flight)

    # ---- uploaded-task storage ---------------------------------------------------------------
    def hold_upload(self, tenant: str, blob_id: str, size: int, limit: int | None, ttl: float) -> bool:
        """Record the tenant as a holder of the blob, counting its bytes unless it held it
        already: True when it is new to the tenant; QuotaRefused (nothing recorded) when its
        bytes would pass `limit`. Its holding lapses with the blob (BlobsState.blob_held_by)."""
        args = [tenant, keys.PREFIX, blob_id, size, -1 if limit is None else limit, int(ttl * 1000)]
        status, total = self._hold(args)
        if status < 0:
            raise QuotaRefused(total, int(limit or 0))
        return status == 1

    def drop_upload(self, tenant: str, blob_id: str) -> None:
        """Undo hold_upload (the blob could not be stored)."""
        pipe = self._r.pipeline()
        pipe.hdel(keys.tenant_uploads_key(tenant), blob_id)
        pipe.srem(keys.blob_holders_key(blob_id), tenant)
        pipe.execute()

    def upload_bytes(self, tenant: str) -> int:
        """The unpacked bytes of the uploaded tasks the tenant holds now."""
        return self._hold([tenant, keys.PREFIX, "", 0, -1, 0])[1]

    def _hold(self, args: list) -> tuple[int, int]:
        status, total = self._script("_hold_upload", _HOLD_UPLOAD)(keys=[keys.tenant_uploads_key(args[0])], args=args)
        return int(status), int(total)
