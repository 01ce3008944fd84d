"""Run, lease and job state in Redis: the one module both the facade and the workers use.

Keys (all under ``tp:``):
  run:<id>              hash: the run record (JSON for structured fields)
  run:<id>:jobs         list: job ids of the run, oldest first
  host:<h>:keys         hash: task_key -> live runs of that key on host h (capacity)
  host:<h>:live         zset: live run ids on host h, scored by last use (reaper)
  host:<h>:closing      set: runs released but not yet torn down
  hosts                 zset: worker hosts, scored by their last heartbeat
  req:<key>:<request>   string: run id of an idempotent allocate (300 s)
  job:<id>              hash: a job record; job:<id>:done list, non-empty once it ended
  node:<name>           string with TTL: a worker process is alive
  sess:<run>:<sid>      hash: read offset and kind of a shell session
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

import redis

PREFIX = "tp:"
IDEMPOTENCY_TTL = 300
RECORD_TTL = 24 * 3600  # closed runs and ended jobs stay readable this long
HOST_ALIVE_SECONDS = 30
NODE_TTL = 15
# Stored as JSON (structured, or possibly null); every other field is a plain string, so a
# client's task_key of "null" or "true" stays that string.
JSON_FIELDS = ("task_meta", "run_ctx", "task_timeouts", "tool_schemas", "tests", "env", "script", "result", "score")


class CapacityError(Exception):
    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


class UnknownRun(KeyError):
    pass


_ALLOCATE = """
local task_key, max_tasks, max_runs = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local run_id, now, req_key, request_id = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
if req_key ~= '' then
  local existing = redis.call('GET', req_key)
  if existing then
    local state = redis.call('HGET', 'tp:run:' .. existing, 'state')
    if state and state ~= 'closing' and state ~= 'closed' then
      redis.call('HSET', 'tp:run:' .. existing, 'last_used_at', now)
      local host = redis.call('HGET', 'tp:run:' .. existing, 'host')
      redis.call('ZADD', 'tp:host:' .. host .. ':live', now, existing)
      return {'reused', existing, host}
    end
  end
end
local chosen, code = nil, 'TASK_SLOTS_EXHAUSTED'
for i = 8, #ARGV do
  local keys_key = 'tp:host:' .. ARGV[i] .. ':keys'
  local n = tonumber(redis.call('HGET', keys_key, task_key) or '0')
  if n > 0 then
    if n < max_runs then chosen = ARGV[i] break end
    code = 'RUN_SLOTS_EXHAUSTED'
  elseif redis.call('HLEN', keys_key) < max_tasks then
    chosen = ARGV[i] break
  end
end
if not chosen then return {'full', code} end
redis.call('HINCRBY', 'tp:host:' .. chosen .. ':keys', task_key, 1)
redis.call('ZADD', 'tp:host:' .. chosen .. ':live', now, run_id)
redis.call('HSET', 'tp:run:' .. run_id, 'run_id', run_id, 'task_key', task_key, 'host', chosen,
  'state', 'allocated', 'created_at', now, 'last_used_at', now, 'request_id', request_id)
if req_key ~= '' then redis.call('SET', req_key, run_id, 'EX', 300) end
return {'new', run_id, chosen}
"""

_RELEASE = """
local run_key = 'tp:run:' .. ARGV[1]
local state = redis.call('HGET', run_key, 'state')
if not state or state == 'closing' or state == 'closed' then return 0 end
if ARGV[4] ~= '' and state ~= ARGV[4] then return 0 end
local host, task_key = redis.call('HGET', run_key, 'host'), redis.call('HGET', run_key, 'task_key')
local keys_key = 'tp:host:' .. host .. ':keys'
if redis.call('HINCRBY', keys_key, task_key, -1) <= 0 then redis.call('HDEL', keys_key, task_key) end
redis.call('ZREM', 'tp:host:' .. host .. ':live', ARGV[1])
redis.call('SADD', 'tp:host:' .. host .. ':closing', ARGV[1])
redis.call('HSET', run_key, 'state', 'closing', 'closing_reason', ARGV[2], 'last_used_at', ARGV[3])
return 1
"""


_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
for i = 2, #ARGV do
  if state == ARGV[i] then redis.call('HSET', KEYS[1], 'state', ARGV[1]) return 1 end
end
return 0
"""


def new_run_id() -> str:
    return "run-" + secrets.token_hex(8)


def _encode(fields: dict) -> dict:
    out = {}
    for key, value in fields.items():
        if key in JSON_FIELDS:
            out[key] = json.dumps(value)
        else:
            out[key] = str(value)
    return out


def _decode(raw: dict) -> dict:
    out = {}
    for key, value in raw.items():
        if key in JSON_FIELDS:
            try:
                out[key] = json.loads(value)
                continue
            except ValueError:
                pass
        out[key] = value
    for key in ("created_at", "last_used_at", "queued_at", "started_at", "finished_at"):
        if isinstance(out.get(key), str):
            try:
                out[key] = float(out[key])
            except ValueError:
                pass
    return out


@dataclass
class Allocation:
    run_id: str
    host: str
    reused: bool


class Store:
    """Typed access to termpool's Redis keys. Safe to share between threads."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._allocate = client.register_script(_ALLOCATE)
        self._release = client.register_script(_RELEASE)
        self._transition = client.register_script(_TRANSITION)

    @classmethod
    def from_url(cls, url: str) -> "Store":
        # Blocking waits (wait_job) poll every few seconds: the socket timeout must exceed that.
        return cls(redis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                        socket_timeout=30, socket_connect_timeout=5))

    def ping(self) -> bool:
        return bool(self.r.ping())

    # ---- worker hosts -------------------------------------------------------------------
    def host_heartbeat(self, host: str) -> None:
        self.r.zadd(PREFIX + "hosts", {host: time.time()})

    def live_hosts(self) -> list[str]:
        return self.r.zrangebyscore(PREFIX + "hosts", time.time() - HOST_ALIVE_SECONDS, "+inf")

    def node_heartbeat(self, node: str) -> None:
        self.r.set(PREFIX + "node:" + node, "1", ex=NODE_TTL)

    def node_alive(self, node: str) -> bool:
        return bool(self.r.exists(PREFIX + "node:" + node))

    # ---- runs ---------------------------------------------------------------------------
    def allocate(self, task_key: str, request_id: str, hosts: list[str], max_tasks: int, max_runs: int) -> Allocation:
        req_key = f"{PREFIX}req:{task_key}:{request_id}" if request_id else ""
        now = str(time.time())
        reply = self._allocate(args=[task_key, max_tasks, max_runs, new_run_id(), now, req_key, request_id, *hosts])
        if reply[0] == "full":
            raise CapacityError(reply[1])
        return Allocation(run_id=reply[1], host=reply[2], reused=reply[0] == "reused")

    def get_run(self, run_id: str) -> dict | None:
        raw = self.r.hgetall(PREFIX + "run:" + run_id) if run_id else {}
        return _decode(raw) if raw else None

    def require_run(self, run_id: str) -> dict:
        run = self.get_run(run_id)
        if run is None:
            raise UnknownRun(run_id)
        return run

    def update_run(self, run_id: str, **fields) -> None:
        if fields:
            self.r.hset(PREFIX + "run:" + run_id, mapping=_encode(fields))

    def touch(self, run_id: str) -> bool:
        """Record use of a live run; False when the lease is unknown or released."""
        run_key = PREFIX + "run:" + run_id
        state, host = self.r.hmget(run_key, "state", "host")
        if state is None or state in ("closing", "closed"):
            return False
        now = time.time()
        pipe = self.r.pipeline()
        pipe.hset(run_key, "last_used_at", now)
        pipe.zadd(f"{PREFIX}host:{host}:live", {run_id: now}, xx=True)
        pipe.execute()
        return True

    def set_state_if_live(self, run_id: str, state: str, **fields) -> bool:
        """Change a run's state unless it has been released meanwhile (close wins)."""
        current = self.r.hget(PREFIX + "run:" + run_id, "state")
        if current is None or current in ("closing", "closed"):
            return False
        self.update_run(run_id, state=state, **fields)
        return True

    def transition(self, run_id: str, from_states: tuple, to_state: str) -> bool:
        """Atomically move a run to to_state only if it is in one of from_states."""
        return bool(self._transition(keys=[PREFIX + "run:" + run_id], args=[to_state, *from_states]))

    def release(self, run_id: str, reason: str = "closed", only_state: str = "") -> bool:
        """Free the run's capacity slot and mark it closing; False if already released (or,
        with only_state, when the run is no longer in that state)."""
        return bool(self._release(args=[run_id, reason, time.time(), only_state]))

    def mark_closed(self, run_id: str, error: str = "") -> None:
        host = self.r.hget(PREFIX + "run:" + run_id, "host")
        pipe = self.r.pipeline()
        pipe.hset(PREFIX + "run:" + run_id, mapping=_encode({"state": "closed", "closed_at": time.time()}))
        if error:
            pipe.hset(PREFIX + "run:" + run_id, "teardown_error", error)
        if host:
            pipe.srem(f"{PREFIX}host:{host}:closing", run_id)
        pipe.expire(PREFIX + "run:" + run_id, RECORD_TTL)
        pipe.expire(PREFIX + "run:" + run_id + ":jobs", RECORD_TTL)
        pipe.execute()
        self.drop_sessions(run_id)

    def idle_runs(self, host: str, idle_ttl: float) -> list[str]:
        return self.r.zrangebyscore(f"{PREFIX}host:{host}:live", "-inf", time.time() - idle_ttl)

    def never_reset_runs(self, host: str, older_than: float) -> list[str]:
        """Runs allocated more than older_than seconds ago that were never reset or started."""
        runs = self.live_runs(host)
        if not runs:
            return []
        pipe = self.r.pipeline()
        for run_id in runs:
            pipe.hmget(PREFIX + "run:" + run_id, "state", "created_at", "start_job")
        cutoff = time.time() - older_than
        return [run_id for run_id, (state, created, start_job) in zip(runs, pipe.execute())
                if state == "allocated" and not start_job and created is not None and float(created) < cutoff]

    def live_runs(self, host: str) -> list[str]:
        return self.r.zrange(f"{PREFIX}host:{host}:live", 0, -1)

    def closing_runs(self, host: str) -> list[str]:
        return list(self.r.smembers(f"{PREFIX}host:{host}:closing"))

    def stale_closing_runs(self, host: str, older_than: float) -> list[str]:
        """Runs released more than older_than seconds ago whose teardown has not ended."""
        runs = self.closing_runs(host)
        if not runs:
            return []
        pipe = self.r.pipeline()
        for run_id in runs:
            pipe.hget(PREFIX + "run:" + run_id, "last_used_at")
        cutoff = time.time() - older_than
        return [run_id for run_id, at in zip(runs, pipe.execute()) if at is None or float(at) < cutoff]

    def host_status(self, host: str) -> dict:
        keys = self.r.hgetall(f"{PREFIX}host:{host}:keys")
        return {
            "active_tasks": len(keys),
            "total_active_runs": sum(int(v) for v in keys.values()),
            "pending_closes": self.r.scard(f"{PREFIX}host:{host}:closing"),
            "tasks": {key: {"active_runs": int(n)} for key, n in sorted(keys.items())},
        }

    # ---- jobs ---------------------------------------------------------------------------
    def create_job(self, job_id: str, run_id: str, kind: str, **extra) -> None:
        pipe = self.r.pipeline()
        pipe.hset(PREFIX + "job:" + job_id, mapping=_encode(
            {"job_id": job_id, "run_id": run_id, "kind": kind, "state": "queued", "queued_at": time.time(), **extra}))
        pipe.rpush(PREFIX + "run:" + run_id + ":jobs", job_id)
        pipe.execute()

    def job_started(self, job_id: str, node: str) -> None:
        self.r.hset(PREFIX + "job:" + job_id, mapping=_encode(
            {"state": "running", "started_at": time.time(), "node": node}))

    def job_finished(self, job_id: str, result=None, error: str = "", **extra) -> None:
        state = "failed" if error else "succeeded"
        fields = {"state": state, "finished_at": time.time(), "result": result, "error": error, **extra}
        pipe = self.r.pipeline()
        pipe.hset(PREFIX + "job:" + job_id, mapping=_encode(fields))
        pipe.rpush(PREFIX + "job:" + job_id + ":done", state)
        pipe.expire(PREFIX + "job:" + job_id, RECORD_TTL)
        pipe.expire(PREFIX + "job:" + job_id + ":done", RECORD_TTL)
        pipe.execute()

    def job_state(self, job_id: str) -> str | None:
        return self.r.hget(PREFIX + "job:" + job_id, "state")

    def get_job(self, job_id: str) -> dict | None:
        raw = self.r.hgetall(PREFIX + "job:" + job_id) if job_id else {}
        return _decode(raw) if raw else None

    def fail_queued_jobs(self, run_id: str, reason: str) -> int:
        """End the jobs of a run that never started (their queue message was lost or skipped)."""
        ended = 0
        for job_id in self.run_jobs(run_id):
            if self.job_state(job_id) == "queued":
                self.job_finished(job_id, error=reason)
                ended += 1
        return ended

    def claim_start(self, run_id: str, job_id: str) -> bool:
        """True for exactly one submission of a run (HSETNX is atomic)."""
        return bool(self.r.hsetnx(PREFIX + "run:" + run_id, "start_job", job_id))

    def start_job(self, run_id: str) -> str | None:
        return self.r.hget(PREFIX + "run:" + run_id, "start_job")

    def set_episode_jobs(self, start_job: str, job_ids: list[str]) -> None:
        """An episode's job ids in chain order, for its error callback."""
        key = PREFIX + "episode:" + start_job
        pipe = self.r.pipeline()
        pipe.rpush(key, *job_ids)
        pipe.expire(key, RECORD_TTL)
        pipe.execute()

    def episode_jobs(self, start_job: str) -> list[str]:
        return self.r.lrange(PREFIX + "episode:" + start_job, 0, -1)

    def run_jobs(self, run_id: str) -> list[str]:
        return self.r.lrange(PREFIX + "run:" + run_id + ":jobs", 0, -1)

    def wait_job(self, job_id: str, timeout: float | None, poll: float = 5.0) -> dict | None:
        """Block until the job has ended (or timeout seconds pass); return its record.

        BLMOVE of the done list onto itself wakes every waiter without consuming the
        signal. Between wake-ups it checks that the worker running the job is alive, so a
        killed worker fails the job instead of hanging the client forever.
        """
        done_key = PREFIX + "job:" + job_id + ":done"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = poll if deadline is None else min(poll, deadline - time.monotonic())
            if left <= 0:
                return self.get_job(job_id)
            if self.r.blmove(done_key, done_key, max(left, 0.01), "LEFT", "RIGHT") is not None:
                return self.get_job(job_id)
            job = self.get_job(job_id)
            if job and job.get("state") == "running" and job.get("node") and not self.node_alive(job["node"]):
                self.job_finished(job_id, error=f"worker {job['node']} was lost while running this job")

    # ---- task images --------------------------------------------------------------------
    def mark_image_ready(self, host: str, task_path: str, ready: bool = True) -> None:
        key = f"{PREFIX}images:{host}"
        if ready:
            self.r.sadd(key, task_path)
        else:
            self.r.srem(key, task_path)

    def image_ready(self, host: str, task_path: str) -> bool:
        return bool(self.r.sismember(f"{PREFIX}images:{host}", task_path))

    # ---- warm pool ----------------------------------------------------------------------
    # tp:warm:<host>:<task_path> lists pre-started containers (JSON entries); LPOP hands each
    # to exactly one run. tp:warmid:<id> says the warm container is still wanted ("pooled" or
    # the run that claimed it), so the reconcile sweep leaves it alone.
    def warm_push(self, host: str, pool: str, entry: dict) -> None:
        pipe = self.r.pipeline()
        pipe.set(PREFIX + "warmid:" + entry["warm_id"], "pooled")
        pipe.rpush(f"{PREFIX}warm:{host}:{pool}", json.dumps(entry))
        pipe.execute()

    def warm_claim(self, host: str, pool: str, run_id: str) -> dict | None:
        raw = self.r.lpop(f"{PREFIX}warm:{host}:{pool}")
        if raw is None:
            return None
        entry = json.loads(raw)
        self.r.set(PREFIX + "warmid:" + entry["warm_id"], run_id)
        return entry

    def warm_count(self, host: str, pool: str) -> int:
        return self.r.llen(f"{PREFIX}warm:{host}:{pool}")

    def warm_known(self, warm_id: str) -> bool:
        return bool(self.r.exists(PREFIX + "warmid:" + warm_id))

    def warm_forget(self, warm_id: str) -> None:
        self.r.delete(PREFIX + "warmid:" + warm_id)

    # ---- shell sessions -----------------------------------------------------------------
    def session(self, run_id: str, sid: str) -> dict:
        return self.r.hgetall(f"{PREFIX}sess:{run_id}:{sid}")

    def update_session(self, run_id: str, sid: str, **fields) -> None:
        key = f"{PREFIX}sess:{run_id}:{sid}"
        self.r.hset(key, mapping={k: str(v) for k, v in fields.items()})
        self.r.sadd(f"{PREFIX}sess:{run_id}", sid)

    def drop_sessions(self, run_id: str) -> None:
        sids = self.r.smembers(f"{PREFIX}sess:{run_id}")
        if sids:
            self.r.delete(*[f"{PREFIX}sess:{run_id}:{sid}" for sid in sids])
        self.r.delete(f"{PREFIX}sess:{run_id}")
