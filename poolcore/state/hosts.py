"""Worker hosts and placement: which hosts and worker processes are alive (hosts, host:<h>:nodes,
:workers, :info, node:<name>, worker:<token>), the images they hold, draining and lost hosts,
and the placement and host-lost scripts that allocate runs on them (poolcore/hosts.py)."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field

import redis

from poolcore import failures, priorities
from poolcore.state import keys
from poolcore.state.runs import new_run_id

HOST_FORGET_SECONDS = 3600  # a host silent this long is dropped from the hosts list and /status
LOST_STATE = "lost"


class CapacityError(Exception):
    def __init__(self, code: str, one_per_host: tuple = (), reason: str = ""):
        super().__init__(code)
        self.code = code
        self.one_per_host = one_per_host  # why the task allows one live run per host, when it does
        self.reason = reason  # HOST_DISK_LOW: each host's shortage


@dataclass
class Allocation:
    run_id: str
    host: str
    reused: bool


@dataclass
class Placement:
    """How allocate weighs hosts (Store.place)."""

    preferred: list  # hosts judged to serve every queue kind (poolcore/hosts.py)
    excluded: list  # hosts judged lost: never a candidate (nor one another process marked lost)
    default_tasks: int  # capacity of a host that has not published its own
    default_runs: int
    slack: float  # load difference image affinity may outweigh
    fallback: str  # the one candidate when no host is known at all
    # Runs of this task key a host may hold at most, below its own max_runs_per_task (0: no
    # cap): a task whose compose file pins addresses allows one (TaskSpec.one_per_host).
    runs_per_host: int = 0
    # The tenant asking ('' for the operator), its max_runs (None: no limit) and every tenant's
    # reserved_runs (docs/tenants.md); none of them without a tenants file.
    tenant: str = ""
    max_runs: int | None = None
    reservations: dict = field(default_factory=dict)
    # The run's priority class (poolcore/priorities.py), recorded with it: its jobs' order.
    priority: str = priorities.DEFAULT


# Placement: every argument is in ARGV (ARGV[1] is the key prefix). The candidates are the
# preferred hosts (judged to serve every queue kind) that are not draining; when there are
# none, every host in the hosts list that is neither excluded (judged lost) nor draining (one
# starting serves once its workers are up; its jobs wait in their queues). Either way, not a
# host some process already marked lost (hosts:lost, see _MARK_LOST) whose beat in the hosts
# list has not moved since: each facade process judges from its own watch, and one that read
# the host's last beat a moment later than another still counts it alive. With no host known
# at all (a fresh Redis) the facade's own host id is the one candidate. Among candidates
# with room for the task key: the least loaded (live runs over its published capacity), unless
# one within `slack` of that load already holds the task's images (images:<h>), then that one.
# With a cap on runs per host (ARGV[17] > 0), the key's runs still being torn down on a host
# (host:<h>:closing) count against it too: they hold what the task pins until they are gone.
# A host whose heartbeat says it is short of disk (host:<h>:info disk_low) takes no new run;
# when that leaves none, the refusal is HOST_DISK_LOW with each host's reason.
# ARGV[21]: the run's priority class (poolcore/priorities.py), recorded with it.
# Tenants (docs/tenants.md; ARGV[18..20]: the tenant, '' for the operator; its max_runs, -1 for
# none; every tenant's reserved_runs as JSON): each tenant's runs that hold a slot are the set
# tenant:<t>:live, joined here and left by every script that frees the slot (RELEASE_LUA,
# _MARK_LOST, MARK_RUN_LOST_LUA), so the count, the check and the take are one step. A tenant at
# its max_runs is refused TENANT_QUOTA_EXCEEDED; one at or above its own reservation may only
# take a slot the other tenants' unused reservations leave free, over the candidates' capacity.
_PLACE = """
local p, task_key, run_id, now, req_key, request_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local preferred, affinity, def_tasks, def_runs = cjson.decode(ARGV[7]), ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
local slack, excluded, fallback, cap = tonumber(ARGV[11]), cjson.decode(ARGV[12]), ARGV[13], tonumber(ARGV[17])
local tenant, quota, reserved = ARGV[18], tonumber(ARGV[19]), cjson.decode(ARGV[20])
local function tenant_live(t) return redis.call('SCARD', p .. 'tenant:' .. t .. ':live') end
-- placed already: this script was sent again (Redis's client resends a command whose reply was lost)
local placed = redis.call('HGET', p .. 'run:' .. run_id, 'host')
if placed then return {'new', run_id, placed} end
if req_key ~= '' then
  local existing = redis.call('GET', req_key)
  if existing then
    local state = redis.call('HGET', p .. 'run:' .. existing, 'state')
    if state and state ~= 'closing' and state ~= 'closed' and state ~= 'lost' then
      redis.call('HSET', p .. 'run:' .. existing, 'last_used_at', now)
      local host = redis.call('HGET', p .. 'run:' .. existing, 'host')
      redis.call('ZADD', p .. 'host:' .. host .. ':live', now, existing)
      return {'reused', existing, host}
    end
  end
end
if tenant ~= '' and quota >= 0 and tenant_live(tenant) >= quota then
  return {'full', 'TENANT_QUOTA_EXCEEDED', 'max_runs'}
end
local function draining(h) return redis.call('SISMEMBER', p .. 'hosts:draining', h) == 1 end
local function marked_lost(h)
  local mark = redis.call('HGET', p .. 'hosts:lost', h)
  if not mark then return false end
  local beat = redis.call('ZSCORE', p .. 'hosts', h)  -- any change is a beat since the mark
  return not beat or tonumber(beat) == tonumber(mark)
end
local function takes_runs(h) return not draining(h) and not marked_lost(h) end
local candidates = {}
for _, h in ipairs(preferred) do if takes_runs(h) then table.insert(candidates, h) end end
if #candidates == 0 then
  local out = {}
  for _, h in ipairs(excluded) do out[h] = true end
  local known = redis.call('ZRANGE', p .. 'hosts', 0, -1)
  for _, h in ipairs(known) do if not out[h] and takes_runs(h) then table.insert(candidates, h) end end
  if #known == 0 and fallback ~= '' then candidates = {fallback} end
end
if #candidates == 0 then return {'full', 'WORKERS_DOWN'} end
local fits, code, low = {}, 'TASK_SLOTS_EXHAUSTED', {}
for _, h in ipairs(candidates) do
  local info = redis.call('HMGET', p .. 'host:' .. h .. ':info', 'max_tasks', 'max_runs_per_task', 'disk_low')
  local max_tasks, max_runs = tonumber(info[1]) or def_tasks, tonumber(info[2]) or def_runs
  if info[3] and info[3] ~= '' then table.insert(low, 'host ' .. h .. ': ' .. info[3]) end
  local keys_key = p .. 'host:' .. h .. ':keys'
  local n = tonumber(redis.call('HGET', keys_key, task_key) or '0')
  local limit, held = max_runs, n
  if cap > 0 then
    limit = math.min(max_runs, cap)
    for _, run in ipairs(redis.call('SMEMBERS', p .. 'host:' .. h .. ':closing')) do
      if redis.call('HGET', p .. 'run:' .. run, 'task_key') == task_key then held = held + 1 end
    end
  end
  local room = false
  if info[3] and info[3] ~= '' then
    room = false  -- short of disk (HOST_DISK_MIN_FREE): no new runs until it has room again
  elseif held > 0 and held >= limit then
    code = 'RUN_SLOTS_EXHAUSTED'
  else
    room = n > 0 or redis.call('HLEN', keys_key) < max_tasks
  end
  if room then
    local load = redis.call('ZCARD', p .. 'host:' .. h .. ':live') / math.max(max_tasks * max_runs, 1)
    table.insert(fits, {h, load, redis.call('SISMEMBER', p .. 'images:' .. h, affinity) == 1})
  end
end
if #fits == 0 and #low == #candidates then return {'full', 'HOST_DISK_LOW', table.concat(low, '; ')} end
if #fits == 0 then return {'full', code} end
if (reserved[tenant] or 0) <= (tenant ~= '' and tenant_live(tenant) or 0) then
  local held_back, free = 0, 0
  for t, n in pairs(reserved) do
    if t ~= tenant then held_back = held_back + math.max(0, n - tenant_live(t)) end
  end
  if held_back > 0 then
    for _, h in ipairs(candidates) do
      local info = redis.call('HMGET', p .. 'host:' .. h .. ':info', 'max_tasks', 'max_runs_per_task')
      local size = (tonumber(info[1]) or def_tasks) * (tonumber(info[2]) or def_runs)
      free = free + math.max(0, size - redis.call('ZCARD', p .. 'host:' .. h .. ':live'))
    end
    if free <= held_back then return {'full', 'TENANT_QUOTA_EXCEEDED', 'reserved'} end
  end
end
local least = fits[1]
for _, f in ipairs(fits) do if f[2] < least[2] then least = f end end
local chosen = least
if not least[3] then
  for _, f in ipairs(fits) do
    if f[3] and f[2] <= least[2] + slack and (chosen == least or f[2] < chosen[2]) then chosen = f end
  end
end
local host = chosen[1]
redis.call('HINCRBY', p .. 'host:' .. host .. ':keys', task_key, 1)
redis.call('ZADD', p .. 'host:' .. host .. ':live', now, run_id)
redis.call('HSET', p .. 'run:' .. run_id, 'run_id', run_id, 'task_key', task_key, 'host', host,
  'state', 'allocated', 'created_at', now, 'last_used_at', now, 'request_id', request_id, 'priority', ARGV[21])
if tenant ~= '' then
  redis.call('HSET', p .. 'run:' .. run_id, 'tenant', tenant)
  redis.call('SADD', p .. 'tenant:' .. tenant .. ':live', run_id)
end
if req_key ~= '' then redis.call('SET', req_key, run_id, 'EX', tonumber(ARGV[14])) end
-- the run viewer's index: the newest runs, expiring with the last record
local recent = p .. 'runs:recent'
redis.call('ZADD', recent, now, run_id)
redis.call('ZREMRANGEBYRANK', recent, 0, -tonumber(ARGV[15]) - 1)
redis.call('EXPIRE', recent, tonumber(ARGV[16]))
return {'new', run_id, host}
"""

# A host is lost: each live run becomes "lost" (HOST_LOST) and leaves the host's capacity count.
# The mark (hosts:lost) is the host's last beat as its judge read it (0: not listed): any beat
# written after that read lifts it (_PLACE), so a host that beats again takes runs at once,
# even when its judge marked it after that beat.
_MARK_LOST = """
local p, h, now, err, beat = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
redis.call('HSET', p .. 'hosts:lost', h, beat)
local live = redis.call('ZRANGE', p .. 'host:' .. h .. ':live', 0, -1)
for _, run in ipairs(live) do
  redis.call('HSET', p .. 'run:' .. run, 'state', 'lost', 'code', 'HOST_LOST', 'error', err,
    'retryable', 'true', 'lost_at', now)
  redis.call('SADD', p .. 'host:' .. h .. ':lost', run)
  local tenant = redis.call('HGET', p .. 'run:' .. run, 'tenant')
  if tenant then redis.call('SREM', p .. 'tenant:' .. tenant .. ':live', run) end
end
redis.call('DEL', p .. 'host:' .. h .. ':live', p .. 'host:' .. h .. ':keys')
return live
"""

# Heartbeats go through a full Redis (maxmemory with noeviction refuses other writes): a beat
# overwrites the same few fields, so it grows nothing, and a refused beat would have the
# failure detectors take a full Redis for dead workers (WORKERS_DOWN, HOST_LOST, lost jobs).
# allow-oom needs a script with flags (Redis 7). Every key is declared.
# KEYS: the key, its hash. ARGV: the key's value, its TTL, the hash field, its value.
_KEY_AND_FIELD_BEAT = """#!lua flags=allow-oom
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if KEYS[2] then redis.call('HSET', KEYS[2], ARGV[3], ARGV[4]) end
return 1
"""
# KEYS: the hosts list, the host's nodes, the host's info. ARGV: host, now, node, "kind now",
# then the info's field, value pairs.
_HOST_BEAT = """#!lua flags=allow-oom
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
if #ARGV > 4 then redis.call('HSET', KEYS[3], unpack(ARGV, 5)) end
return 1
"""


class HostsState:
    """Store's worker hosts, their processes and placement."""

    _r: redis.Redis  # Store.__init__ sets it
    record_ttl: int  # and this (RECORD_TTL)
    recent_runs_kept: int  # Store's

    # ---- worker hosts -------------------------------------------------------------------
    def live_hosts(self) -> list[str]:
        return self._r.zrangebyscore(keys.HOSTS, time.time() - keys.HOST_ALIVE_SECONDS, "+inf")

    @functools.cached_property
    def _key_and_field_beat(self):
        return self._r.register_script(_KEY_AND_FIELD_BEAT)

    @functools.cached_property
    def _host_beat(self):
        return self._r.register_script(_HOST_BEAT)

    def node_heartbeat(self, node: str) -> None:
        self._key_and_field_beat(keys=[keys.node_key(node)], args=["1", keys.NODE_TTL])

    def node_alive(self, node: str) -> bool:
        return bool(self._r.exists(keys.node_key(node)))

    # ---- task images --------------------------------------------------------------------
    def mark_image_ready(self, host: str, task_path: str, ready: bool = True) -> None:
        key = keys.images_key(host)
        if ready:
            self._r.sadd(key, task_path)
        else:
            self._r.srem(key, task_path)

    def image_ready(self, host: str, task_path: str) -> bool:
        return bool(self._r.sismember(keys.images_key(host), task_path))

    def ready_images(self, host: str) -> set[str]:
        """The task paths whose images host has built (and not removed since)."""
        return self._r.smembers(keys.images_key(host))

    # ---- worker processes (tasks/lost_jobs.py; the jobs they run: JobsState) --------------
    # A worker process is known by a random token, new for every process, so a restarted
    # worker that gets its predecessor's node name is still told apart from it.
    def worker_beat(self, host: str, token: str, facts: dict) -> None:
        """A worker process is alive (for NODE_TTL seconds); facts say how to check its pid."""
        self._key_and_field_beat(
            keys=[keys.worker_key(token), keys.host_workers_key(host)],
            args=[facts.get("node", ""), keys.NODE_TTL, token, json.dumps(facts)],
        )

    def worker_alive(self, token: str) -> bool:
        return bool(self._r.exists(keys.worker_key(token)))

    def worker_stopped(self, token: str) -> None:
        """A worker process that shuts down cleanly is dead at once, not NODE_TTL later."""
        self._r.delete(keys.worker_key(token))

    def host_workers(self, host: str) -> dict[str, dict]:
        return {token: json.loads(facts) for token, facts in self._r.hgetall(keys.host_workers_key(host)).items()}

    def forget_worker(self, host: str, token: str) -> None:
        pipe = self._r.pipeline()
        pipe.hdel(keys.host_workers_key(host), token)
        pipe.delete(keys.worker_key(token), keys.worker_jobs_key(token))
        pipe.execute()

    def host_watched(self, host: str) -> bool:
        """Some worker process of the host beat within NODE_TTL: its lost-job scan is running."""
        score = self._r.zscore(keys.HOSTS, host)
        return score is not None and score > time.time() - keys.NODE_TTL

    # ---- many hosts: liveness per queue kind, placement, drain, loss (poolcore/hosts.py) --------
    @functools.cached_property
    def _place(self):
        return self._r.register_script(_PLACE)

    @functools.cached_property
    def _mark_lost(self):
        return self._r.register_script(_MARK_LOST)

    # ---- heartbeats -------------------------------------------------------------------------
    def host_beat(self, host: str, node: str, kind: str, capacity: dict, now: float | None = None) -> None:
        """A worker process of `host` consuming queue `kind` is alive (at `now`, default: now);
        capacity: its host's limits."""
        now = time.time() if now is None else now
        info = [str(part) for item in capacity.items() for part in item]
        self._host_beat(
            keys=[keys.HOSTS, keys.host_nodes_key(host), keys.host_info_key(host)],
            args=[host, repr(now), node, f"{kind} {now}", *info],
        )

    def host_node_stopped(self, host: str, node: str, kind: str) -> None:
        """A worker process stopped cleanly: its kind is down at once; the host leaves the hosts
        list with its last process."""
        key = keys.host_nodes_key(host)
        self._r.hset(key, node, f"{kind} 0")
        if not any(float(value.split()[1]) > 0 for value in self._r.hvals(key)):
            self._r.zrem(keys.HOSTS, host)

    def known_hosts(self) -> dict[str, float]:
        """Every host in the hosts list, with its last heartbeat."""
        return dict(self._r.zrange(keys.HOSTS, 0, -1, withscores=True))

    def forget_host(self, host: str) -> None:
        pipe = self._r.pipeline()
        pipe.zrem(keys.HOSTS, host)
        pipe.hdel(keys.LOST_HOSTS, host)
        pipe.delete(keys.host_nodes_key(host), keys.host_info_key(host))
        pipe.execute()

    # ---- placement --------------------------------------------------------------------------
    def place(self, task_key: str, request_id: str, affinity: str, rule: Placement) -> Allocation:
        """Allocate a run on the best host (see _PLACE); CapacityError when none has room
        (code WORKERS_DOWN when every known host is lost or draining)."""
        req_key = keys.request_key(task_key, request_id, rule.tenant) if request_id else ""
        now = str(time.time())
        preferred, excluded = json.dumps(rule.preferred), json.dumps(rule.excluded)
        args = [keys.PREFIX, task_key, new_run_id(), now, req_key, request_id, preferred, affinity]
        args += [rule.default_tasks, rule.default_runs, rule.slack, excluded, rule.fallback, keys.IDEMPOTENCY_TTL]
        args += [self.recent_runs_kept, self.record_ttl, rule.runs_per_host]
        args += [rule.tenant, -1 if rule.max_runs is None else rule.max_runs, json.dumps(rule.reservations)]
        args += [rule.priority]
        reply = self._place(args=args)
        if reply[0] == "full":
            raise CapacityError(reply[1], reason=reply[2] if len(reply) > 2 else "")
        return Allocation(run_id=reply[1], host=reply[2], reused=reply[0] == "reused")

    def beats_snapshot(self, also: set) -> tuple[dict, set, dict]:
        """What a liveness watch reads (poolcore/liveness.py), in two round trips: the hosts list
        with last beats, the draining hosts, and node -> (kind, beat) of those hosts and `also`."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zrange(keys.HOSTS, 0, -1, withscores=True)
        pipe.smembers(keys.DRAINING)
        listed, draining = pipe.execute()
        listed = dict(listed)
        names = sorted(set(listed) | set(also))
        pipe = self._r.pipeline(transaction=False)
        for host in names:
            pipe.hgetall(keys.host_nodes_key(host))
        nodes = {host: _nodes(raw) for host, raw in zip(names, pipe.execute())}
        return listed, draining, nodes

    def set_live_restore(self, host: str, enabled: bool) -> None:
        """Whether the host's Docker engine keeps its containers running across its own restart."""
        self._r.hset(keys.host_info_key(host), "live_restore", int(enabled))

    def host_info(self, host: str) -> dict:
        return self._r.hgetall(keys.host_info_key(host))

    def host_load(self, host: str) -> dict:
        """Live runs and images cached on the host (for /status and `hosts list`)."""
        pipe = self._r.pipeline()
        pipe.zcard(keys.host_live_key(host))
        pipe.scard(keys.images_key(host))
        pipe.scard(keys.host_lost_key(host))
        live, images, lost = pipe.execute()
        return {"live_runs": live, "images_cached": images, "lost_runs": lost}

    # ---- drain ------------------------------------------------------------------------------
    def set_draining(self, host: str, draining: bool) -> None:
        if draining:
            self._r.sadd(keys.DRAINING, host)
        else:
            self._r.srem(keys.DRAINING, host)

    def draining_hosts(self) -> set[str]:
        return self._r.smembers(keys.DRAINING)

    # ---- loss -------------------------------------------------------------------------------
    def lost_marks(self) -> dict[str, float]:
        """Each host some process marked lost, with its last beat as that judge read it."""
        return {host: float(beat) for host, beat in self._r.hgetall(keys.LOST_HOSTS).items()}

    def mark_host_lost(self, host: str, error: str, beat: float) -> list[str]:
        """Mark the host's live runs lost and free its capacity; returns those runs. `beat`: the
        host's last beat in the hosts list as its judge read it (0: not listed); no process
        places on the host until a later beat (see _PLACE)."""
        runs = self._mark_lost(args=[keys.PREFIX, host, time.time(), failures.cap(error), repr(float(beat))])
        for run_id in runs:
            for job_id in self.run_jobs(run_id):
                self.fail_lost_job(job_id, error, code="HOST_LOST")
        return runs

    def lost_runs(self, host: str) -> list[str]:
        return list(self._r.smembers(keys.host_lost_key(host)))

    def settle_lost_runs(self, host: str, older_than: float = 0.0) -> list[str]:
        """The host is back: its runs lost more than `older_than` seconds ago are closed, so its
        reconcile removes their containers (younger ones still answer HOST_LOST meanwhile)."""
        cutoff = time.time() - older_than
        settled = []
        for run_id in self.lost_runs(host):
            if float(self._r.hget(keys.run_key(run_id), "lost_at") or 0) > cutoff:
                continue
            if self.transition(run_id, (LOST_STATE,), "closed"):
                self.mark_closed(run_id)
            self._r.srem(keys.host_lost_key(host), run_id)
            settled.append(run_id)
        return settled


def _nodes(raw: dict) -> dict[str, tuple[str, float]]:
    """A host's nodes hash as node -> (queue kind, last beat; 0 once it stopped)."""
    out = {}
    for node, value in raw.items():
        kind, _, at = value.partition(" ")
        out[node] = (kind, float(at or 0))
    return out
