"""The warm pool (tasks/warm_pool.py): pre-started containers per host and task (warm:, warmid:,
warm-starting:, warm-demand:, warm-facts:, warm-tasks:, warm-counts:) and the scripts that
reserve, trim and forget them."""

from __future__ import annotations

import functools
import json
import math
import secrets
import time

import redis

from poolcore.state import keys

# The warm pool's scripts (Store.warm_*): each decides from the pool's state in one step.
# KEYS: pool list, starting zset. ARGV: now, lapse time, target, at most starting, candidate ids.
_WARM_RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
local starting = redis.call('ZCARD', KEYS[2])
local n = math.min(tonumber(ARGV[3]) - redis.call('LLEN', KEYS[1]) - starting,
                   tonumber(ARGV[4]) - starting, #ARGV - 4)
local ids = {}
for i = 1, n do
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[4 + i])
  ids[i] = ARGV[4 + i]
end
return ids
"""
# KEYS: pool list. ARGV: spares to keep, pooled-before cutoff, warmid key prefix.
_WARM_TRIM = """
local out = {}
while true do
  local head = redis.call('LINDEX', KEYS[1], 0)
  if not head then break end
  local entry = cjson.decode(head)
  local old = (tonumber(entry['pushed_at']) or 0) < tonumber(ARGV[2])
  if redis.call('LLEN', KEYS[1]) <= tonumber(ARGV[1]) and not old then break end
  redis.call('LPOP', KEYS[1])
  redis.call('DEL', ARGV[3] .. entry['warm_id'])
  out[#out + 1] = head
end
return out
"""
# KEYS: pool list. ARGV: warmid key prefix, the claiming run. One step: a claimer killed between
# the pop and the owner's write would leave the spare "pooled" in nobody's pool, kept forever.
# A command whose reply a partition lost may have run, and Redis's client sends it again
# (state/connection.py): the claim answers a run's second try with its first spare, while that
# spare is still the run's (one found dead and removed is not given again).
# KEYS: pool list, the run's claim key. ARGV: warmid key prefix, the claiming run, claim ttl.
_WARM_CLAIM = """
local prior = redis.call('GET', KEYS[2])
if prior and redis.call('GET', ARGV[1] .. cjson.decode(prior)['warm_id']) == ARGV[2] then return prior end
local raw = redis.call('LPOP', KEYS[1])
if not raw then return false end
redis.call('SET', ARGV[1] .. cjson.decode(raw)['warm_id'], ARGV[2])
redis.call('SET', KEYS[2], raw, 'EX', ARGV[3])
return raw
"""
# A spare goes into the pool once: a push sent again (its reply lost) must not list it twice,
# which would hand one container to two runs. KEYS: its warmid key, pool list, starting zset,
# tasks set. ARGV: the entry, its warm id, the pool.
_WARM_PUSH = """
local state = redis.call('GET', KEYS[1])
if state and state ~= 'starting' then return 0 end
redis.call('SET', KEYS[1], 'pooled')
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
return 1
"""
CLAIM_KEPT_SECONDS = 3600  # a claim's retry comes within the outage window (seconds), not hours
# Counters added once per event (KEYS[1], a mark kept an hour); ARGV: name, amount pairs.
_WARM_COUNT = """
if not redis.call('SET', KEYS[1], 1, 'NX', 'EX', 3600) then return 0 end
for i = 1, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1]) end
return 1
"""

# Its facts go too: every task a host ever pooled (each uploaded task is one) would keep a hash.
# KEYS: tasks set, pool list, starting zset, demand zset, facts hash. ARGV: task path, now, window start.
_WARM_FORGET_TASK = """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
if redis.call('LLEN', KEYS[2]) + redis.call('ZCARD', KEYS[3]) + redis.call('EXISTS', KEYS[4]) > 0 then
  return 0
end
redis.call('DEL', KEYS[5])
return redis.call('SREM', KEYS[1], ARGV[1])
"""


class WarmState:
    """Store's warm pools."""

    _r: redis.Redis  # Store.__init__ sets it

    # ---- warm pool (tasks/warm_pool.py) ------------------------------------------------------
    # tp:warm:<host>:<task_path> lists pre-started containers (JSON entries, oldest first); LPOP
    # hands each to exactly one run. tp:warmid:<id> says the warm container is still wanted
    # ("starting", "pooled" or the run that claimed it), so the reconcile sweep leaves it alone.
    def warm_note_reset(self, host: str, pool: str, run_id: str, task_name: str, claimed: bool, window: float):
        """A reset of the task on this host (served from the pool or not): the pool's demand."""
        now = time.time()
        demand = keys.warm_demand_key(host, pool)
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(demand, {f"{run_id} {now}": now})
        pipe.zremrangebyscore(demand, "-inf", now - window)
        pipe.expire(demand, max(1, math.ceil(window)))
        pipe.sadd(keys.warm_tasks_key(host), pool)
        pipe.hset(keys.warm_facts_key(host, pool), "task_name", task_name)
        pipe.execute()
        self.warm_count_event(host, claimed=int(claimed), missed=int(not claimed))

    def warm_resets(self, host: str, pool: str, window: float) -> list[float]:
        """Times of the task's resets on this host within the last `window` seconds."""
        since = time.time() - window
        return [at for _, at in self._r.zrangebyscore(keys.warm_demand_key(host, pool), since, "+inf", withscores=True)]

    def warm_reserve(self, host: str, pool: str, target: int, at_once: int, ttl: float) -> list[str]:
        """Warm ids to start now: as many as bring pooled + starting up to `target`, with at
        most `at_once` starting. Each is claimed ("starting", for `ttl` seconds) before its
        container exists, so a sweep during the start spares it; warm_push makes the claim
        permanent, a start that dies lets it lapse."""
        candidates = ["warm-" + secrets.token_hex(8) for _ in range(max(0, min(target, at_once)))]
        if not candidates:
            return []
        now = time.time()
        ids = self._warm_reserve(
            keys=[keys.warm_key(host, pool), keys.warm_starting_key(host, pool)],
            args=[now, now + ttl, target, at_once, *candidates],
        )
        if ids:
            pipe = self._r.pipeline(transaction=False)
            for warm_id in ids:
                pipe.set(keys.warm_id_key(warm_id), "starting", ex=max(1, int(ttl)))
            pipe.execute()
        return ids

    def warm_take_starting(self, host: str, pool: str) -> list[str]:
        """Every start reservation of the task on this host, taken back: for a lifecycle worker
        that starts or stops cleanly, as none of them is being started then (one lifecycle
        worker per host)."""
        key = keys.warm_starting_key(host, pool)
        pipe = self._r.pipeline()
        pipe.zrange(key, 0, -1)
        pipe.delete(key)
        ids = pipe.execute()[0]
        if ids:
            self._r.delete(*[keys.warm_id_key(warm_id) for warm_id in ids])
        return ids

    def warm_unreserve(self, host: str, pool: str, warm_id: str) -> None:
        """A start that failed: its claim goes (its container, if any, is removed by the caller)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zrem(keys.warm_starting_key(host, pool), warm_id)
        pipe.delete(keys.warm_id_key(warm_id))
        pipe.execute()

    def warm_push(self, host: str, pool: str, entry: dict) -> bool:
        """Pool a started spare; False when it was pooled (or claimed) already."""
        entry = {"pushed_at": time.time(), **entry}
        warm_id = entry["warm_id"]
        pool_keys = [
            keys.warm_id_key(warm_id),
            keys.warm_key(host, pool),
            keys.warm_starting_key(host, pool),
            keys.warm_tasks_key(host),
        ]
        return bool(self._warm_push(keys=pool_keys, args=[json.dumps(entry), warm_id, pool]))

    def warm_claim(self, host: str, pool: str, run_id: str) -> dict | None:
        """The oldest spare, handed to `run_id` alone (its warmid key names the run); the same
        one again when the run asks again."""
        raw = self._warm_claim(
            keys=[keys.warm_key(host, pool), keys.warm_claim_key(run_id)],
            args=[keys.warm_id_key(""), run_id, CLAIM_KEPT_SECONDS],
        )
        return json.loads(raw) if raw else None

    def warm_trim(self, host: str, pool: str, keep: int, cutoff: float) -> list[dict]:
        """Take out of the pool (oldest first) the spares beyond `keep` and those pooled before
        `cutoff`; they are no longer wanted (a sweep removes any its caller does not)."""
        raw = self._warm_trim(keys=[keys.warm_key(host, pool)], args=[keep, cutoff, keys.warm_id_key("")])
        return [json.loads(entry) for entry in raw]

    def warm_count(self, host: str, pool: str) -> int:
        return self._r.llen(keys.warm_key(host, pool))

    def warm_starting(self, host: str, pool: str) -> int:
        return self._r.zcount(keys.warm_starting_key(host, pool), time.time(), "+inf")

    def warm_tasks(self, host: str) -> set[str]:
        return self._r.smembers(keys.warm_tasks_key(host))

    def warm_pools(self, host: str) -> dict[str, list[dict]]:
        """Every pool of the host: task path -> its pooled entries."""
        pools = sorted(self.warm_tasks(host))
        pipe = self._r.pipeline(transaction=False)
        for pool in pools:
            pipe.lrange(keys.warm_key(host, pool), 0, -1)
        return {pool: [json.loads(e) for e in raw] for pool, raw in zip(pools, pipe.execute())}

    def warm_forget_task(self, host: str, pool: str, window: float) -> bool:
        """Stop looking after a task with no spares, no starts and no reset in `window` seconds
        (its measured facts forgotten: a task pooled again measures them again)."""
        pool_keys = [
            keys.warm_tasks_key(host),
            keys.warm_key(host, pool),
            keys.warm_starting_key(host, pool),
            keys.warm_demand_key(host, pool),
            keys.warm_facts_key(host, pool),
        ]
        now = time.time()
        return bool(self._warm_forget_task(keys=pool_keys, args=[pool, now, now - window]))

    def warm_facts(self, host: str, pool: str) -> dict:
        """task_name, start_s and idle_bytes (the measured ones as numbers) of the task's spares."""
        facts = self._r.hgetall(keys.warm_facts_key(host, pool))
        for name in ("start_s", "idle_bytes"):
            if name in facts:
                facts[name] = float(facts[name])
        return facts

    def warm_set_facts(self, host: str, pool: str, **facts) -> None:
        self._r.hset(keys.warm_facts_key(host, pool), mapping={k: str(v) for k, v in facts.items()})

    def warm_count_event(self, host: str, **amounts: float) -> None:
        """Add to the host's warm pool counters (floats allowed: seconds), once: the event's
        mark (a random id, the same if Redis's client sends the script again) is set first."""
        event = keys.warm_counted_key(secrets.token_hex(8))
        pairs = [item for name, amount in amounts.items() if amount for item in (name, amount)]
        if pairs:
            self._warm_count(keys=[event, keys.warm_counts_key(host)], args=pairs)

    def warm_counters(self, host: str) -> dict[str, float]:
        return {name: float(value) for name, value in self._r.hgetall(keys.warm_counts_key(host)).items()}

    def warm_known(self, warm_id: str) -> bool:
        """Still wanted: pooled, or claimed by a run not yet closed (a start whose worker died
        after claiming leaves a claim that no teardown removes: it goes once the run closes)."""
        owner = self._r.get(keys.warm_id_key(warm_id))
        if owner is None or not owner.startswith("run-"):
            return owner is not None
        return self._r.hget(keys.run_key(owner), "state") not in (None, "closed")

    def warm_forget(self, warm_id: str) -> None:
        self._r.delete(keys.warm_id_key(warm_id))

    @functools.cached_property
    def _warm_reserve(self):
        return self._r.register_script(_WARM_RESERVE)

    @functools.cached_property
    def _warm_claim(self):
        return self._r.register_script(_WARM_CLAIM)

    @functools.cached_property
    def _warm_push(self):
        return self._r.register_script(_WARM_PUSH)

    @functools.cached_property
    def _warm_trim(self):
        return self._r.register_script(_WARM_TRIM)

    @functools.cached_property
    def _warm_count(self):
        return self._r.register_script(_WARM_COUNT)

    @functools.cached_property
    def _warm_forget_task(self):
        return self._r.register_script(_WARM_FORGET_TASK)
