"""Forks of a live run: placing its children on its host (run:<child>, host:<h>:keys, :live)
and the committed images they start from, reference-counted (fork-image:<image>: the runs that
need it; fork-images:<run>: the images a run needs, its own and its ancestors')."""

from __future__ import annotations

import json
import time

import redis

from poolcore.state import keys
from poolcore.state.runs import STARTED_STATES

# Reserve K slots of the source's task key on the source's host, or none: one script, so two
# forks (or a fork and an allocate) cannot both take the last slots. The children copy what a
# start reads (task_meta, run_ctx, task_timeouts) and are "starting" until the fork job has
# made their containers. ARGV: prefix, source, now, max depth, default max runs, cap (0: none),
# recent-runs size, recent-runs TTL, the started states as JSON, the fork job, the max_runs of the
# source's tenant (-1: none; docs/tenants.md), then the child ids. The children are the source's
# tenant's, and join its live set (as _PLACE's runs do); they keep its priority class.
FORK_PLACE_LUA = """
local p, src, now, max_depth = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local def_runs, cap, started = tonumber(ARGV[5]), tonumber(ARGV[6]), cjson.decode(ARGV[9])
local run_key = p .. 'run:' .. src
local state = redis.call('HGET', run_key, 'state')
if not state then return {'UNKNOWN_RUN'} end
-- placed already: this script was sent again (Redis's client resends a command whose reply was lost)
local placed = redis.call('HGET', p .. 'run:' .. ARGV[12], 'fork_job')
if placed == ARGV[10] then return {'OK', redis.call('HGET', run_key, 'host')} end
if state == 'closing' or state == 'closed' then return {'RUN_CLOSED', state} end
if state == 'lost' then return {'HOST_LOST', state} end
local ok = false
for _, s in ipairs(started) do if s == state then ok = true end end
if not ok then return {'RUN_NOT_READY', state} end
local depth = tonumber(redis.call('HGET', run_key, 'fork_depth') or '0') + 1
if depth > max_depth then return {'FORK_TOO_DEEP', tostring(depth - 1)} end
local host, task_key = redis.call('HGET', run_key, 'host'), redis.call('HGET', run_key, 'task_key')
local k = #ARGV - 11
local tenant, quota = redis.call('HGET', run_key, 'tenant'), tonumber(ARGV[11])
if tenant and quota >= 0 and redis.call('SCARD', p .. 'tenant:' .. tenant .. ':live') + k > quota then
  return {'TENANT_QUOTA_EXCEEDED', tostring(quota)}
end
local keys_key = p .. 'host:' .. host .. ':keys'
local held = tonumber(redis.call('HGET', keys_key, task_key) or '0')
local limit = tonumber(redis.call('HGET', p .. 'host:' .. host .. ':info', 'max_runs_per_task')) or def_runs
if cap > 0 then limit = math.min(limit, cap) end
if held + k > limit then return {'RUN_SLOTS_EXHAUSTED', tostring(limit - held)} end
redis.call('HINCRBY', keys_key, task_key, k)
local copied = redis.call('HMGET', run_key, 'task_meta', 'run_ctx', 'task_timeouts', 'priority')
for i = 12, #ARGV do
  local child = ARGV[i]
  redis.call('ZADD', p .. 'host:' .. host .. ':live', now, child)
  redis.call('HSET', p .. 'run:' .. child, 'run_id', child, 'task_key', task_key, 'host', host,
    'state', 'starting', 'created_at', now, 'last_used_at', now, 'request_id', '', 'parent', src,
    'fork_depth', tostring(depth), 'task_meta', copied[1] or 'null', 'run_ctx', copied[2] or 'null',
    'task_timeouts', copied[3] or 'null', 'fork_job', ARGV[10])
  if copied[4] then redis.call('HSET', p .. 'run:' .. child, 'priority', copied[4]) end
  if tenant then
    redis.call('HSET', p .. 'run:' .. child, 'tenant', tenant)
    redis.call('SADD', p .. 'tenant:' .. tenant .. ':live', child)
  end
  redis.call('ZADD', p .. 'runs:recent', now, child)
end
redis.call('ZREMRANGEBYRANK', p .. 'runs:recent', 0, -tonumber(ARGV[7]) - 1)
redis.call('EXPIRE', p .. 'runs:recent', tonumber(ARGV[8]))
return {'OK', host}
"""

# A run no longer needs its images (closed, or a child that was never made): the images no run
# needs any more are returned, for the caller to remove. ARGV: prefix, run.
DROP_IMAGES_LUA = """
local p, run = ARGV[1], ARGV[2]
local mine = p .. 'fork-images:' .. run
local unused = {}
for _, image in ipairs(redis.call('SMEMBERS', mine)) do
  local users = p .. 'fork-image:' .. image
  redis.call('SREM', users, run)
  if redis.call('SCARD', users) == 0 then table.insert(unused, image) end
end
redis.call('DEL', mine)
return unused
"""


class ForkRefused(Exception):
    """The source cannot be forked now; `code` says why, `detail` the state or the room left."""

    def __init__(self, code: str, detail: str = ""):
        super().__init__(code)
        self.code = code
        self.detail = detail


class ForksState:
    """Store's forks: placement of children and the committed images' reference counts."""

    _r: redis.Redis  # Store.__init__ sets it
    recent_runs_kept: int  # Store's

    def place_fork(
        self,
        source: str,
        children: list[str],
        job_id: str,
        max_depth: int,
        default_runs: int,
        cap: int = 0,
        tenant_quota: int | None = None,
    ) -> str:
        """Reserve a slot per child on the source's host and record the children (state
        "starting"); the host. ForkRefused, with nothing written, when it cannot."""
        reply = self._fork_place(
            args=[
                keys.PREFIX,
                source,
                time.time(),
                max_depth,
                default_runs,
                cap,
                self.recent_runs_kept,
                keys.RECORD_TTL,
                json.dumps(list(STARTED_STATES)),
                job_id,
                -1 if tenant_quota is None else tenant_quota,
                *children,
            ]
        )
        if reply[0] != "OK":
            raise ForkRefused(reply[0], reply[1] if len(reply) > 1 else "")
        return reply[1]

    def add_children(self, run_id: str, children: list[str]) -> None:
        """Append to the run's `children` (a JSON list in its record), safe against another
        fork of it ending at the same time (optimistic: WATCH, and again on a conflict)."""
        key = keys.run_key(run_id)
        with self._r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    known = json.loads(pipe.hget(key, "children") or "[]")
                    pipe.multi()
                    pipe.hset(key, "children", json.dumps([*known, *children]))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def need_images(self, run_id: str, images: list[str]) -> None:
        """The run's containers start from these images (or from images made from them)."""
        if not images:
            return
        pipe = self._r.pipeline()
        pipe.sadd(keys.fork_images_key(run_id), *images)
        for image in images:
            pipe.sadd(keys.fork_image_key(image), run_id)
        pipe.execute()

    def images_needed(self, run_id: str) -> list[str]:
        return sorted(self._r.smembers(keys.fork_images_key(run_id)))

    def image_users(self, image: str) -> list[str]:
        return sorted(self._r.smembers(keys.fork_image_key(image)))

    def drop_images(self, run_id: str) -> list[str]:
        """The run needs its images no more; those no run needs now (to be removed)."""
        return list(self._drop_images(args=[keys.PREFIX, run_id]))

    def forget_image(self, image: str) -> None:
        self._r.delete(keys.fork_image_key(image))

    def set_fork_processes(self, host: str, carried: bool, reason: str) -> None:
        """Whether host's forks carry processes, and why (forking.process_carry): read by the
        fork job and shown in /status."""
        self._r.hset(
            keys.host_info_key(host), mapping={"fork_processes": reason, "fork_processes_carried": int(carried)}
        )

    def carries_processes(self, host: str) -> bool:
        return self._r.hget(keys.host_info_key(host), "fork_processes_carried") == "1"
