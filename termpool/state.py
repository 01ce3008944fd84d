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
  count:failures        hash: failure code -> failed jobs (for /metrics)
  count:retries         hash: "<task>|<reason code>" -> automatic retries (for /metrics)
  build-lock:<h>:<image>, warm-lock:<h>:<task path>
                        string with a short TTL: a lock, its value names the owner process
  worker:<token>        string with TTL: one worker process (incarnation) is alive
  host:<h>:workers      hash: token -> JSON facts of the worker processes of host h
  worker:<token>:jobs   set: jobs that worker process is running now (lost if it dies)
  runs:recent           zset: run ids by creation time, newest RECENT_RUNS_KEPT (the run viewer)
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass

import redis

from termpool import failures, processes

log = logging.getLogger(__name__)

PREFIX = "tp:"
IDEMPOTENCY_TTL = 300
RECORD_TTL = 24 * 3600  # closed runs and ended jobs stay readable this long
HOST_ALIVE_SECONDS = 30
NODE_TTL = 12  # a worker process counts as dead this long after its last heartbeat (every 3-5 s)
# Stored as JSON (structured, or possibly null); every other field is a plain string, so a
# client's task_key of "null" or "true" stays that string.
JSON_FIELDS = (
    "task_meta",
    "run_ctx",
    "task_timeouts",
    "tool_schemas",
    "tests",
    "env",
    "script",
    "result",
    "score",
    "retryable",
    "call",
)
INT_FIELDS = ("attempts",)
NO_FAILURE = {"error": "", "code": "", "retryable": None}  # update_run(**NO_FAILURE): forget a failure
FAILURE_COUNTS = PREFIX + "count:failures"
RETRY_COUNTS = PREFIX + "count:retries"
RECENT_RUNS = PREFIX + "runs:recent"
RECENT_RUNS_KEPT = 5000


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
    for key in ("created_at", "last_used_at", "closed_at", "queued_at", "started_at", "finished_at"):
        if isinstance(out.get(key), str):
            try:
                out[key] = float(out[key])
            except ValueError:
                pass
    for key in INT_FIELDS:
        if isinstance(out.get(key), str) and out[key].isdigit():
            out[key] = int(out[key])
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
    def from_url(cls, url: str) -> Store:
        # Blocking waits (wait_job) poll every few seconds: the socket timeout must exceed that.
        return cls(
            redis.Redis.from_url(
                url, decode_responses=True, health_check_interval=30, socket_timeout=30, socket_connect_timeout=5
            )
        )

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
        if reply[0] == "new":
            self._index_run(reply[1], float(now))
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
        return [
            run_id
            for run_id, (state, created, start_job) in zip(runs, pipe.execute())
            if state == "allocated" and not start_job and created is not None and float(created) < cutoff
        ]

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

    # ---- recent runs (the run viewer) ------------------------------------------------------
    def _index_run(self, run_id: str, created_at: float) -> None:
        """Index a new run by creation time; the index keeps the newest RECENT_RUNS_KEPT and,
        like the records, expires RECORD_TTL after the last run was created."""
        pipe = self.r.pipeline()
        pipe.zadd(RECENT_RUNS, {run_id: created_at})
        pipe.zremrangebyrank(RECENT_RUNS, 0, -RECENT_RUNS_KEPT - 1)
        pipe.expire(RECENT_RUNS, RECORD_TTL)
        pipe.execute()

    def recent_runs(self, fields: tuple, count: int, before: float | None = None) -> tuple[list[dict], float | None]:
        """Up to `count` indexed runs created before `before` (all when None), newest first,
        with the given fields of their records; and where to continue (None at the end).
        Ids whose record has expired are dropped from the index."""
        upper = "+inf" if before is None else f"({before!r}"
        page = self.r.zrevrangebyscore(RECENT_RUNS, upper, "-inf", start=0, num=count, withscores=True)
        pipe = self.r.pipeline()
        for run_id, _ in page:
            pipe.hmget(PREFIX + "run:" + run_id, "state", *fields)
        runs, gone = [], []
        for (run_id, _), values in zip(page, pipe.execute()):
            if values[0] is None:
                gone.append(run_id)
                continue
            found = {field: value for field, value in zip(("state", *fields), values) if value is not None}
            runs.append(_decode({**found, "run_id": run_id}))
        if gone:
            self.r.zrem(RECENT_RUNS, *gone)
        return runs, (page[-1][1] if len(page) == count else None)

    def first_jobs(self, run_ids: list[str], fields: tuple) -> dict[str, dict]:
        """The first job of each run (its start job, if it was ever started), by run id."""
        pipe = self.r.pipeline()
        for run_id in run_ids:
            pipe.lindex(PREFIX + "run:" + run_id + ":jobs", 0)
        job_ids = dict(zip(run_ids, pipe.execute()))
        pipe = self.r.pipeline()
        for job_id in filter(None, job_ids.values()):
            pipe.hmget(PREFIX + "job:" + job_id, "kind", *fields)
        values = iter(pipe.execute())
        jobs = {}
        for run_id, job_id in job_ids.items():
            if job_id:
                record = dict(zip(("kind", *fields), next(values)))
                jobs[run_id] = _decode({k: v for k, v in record.items() if v is not None} | {"job_id": job_id})
        return jobs

    def get_jobs(self, job_ids: list[str]) -> list[dict]:
        """Several job records in one round trip, in order; expired ones are left out."""
        pipe = self.r.pipeline()
        for job_id in job_ids:
            pipe.hgetall(PREFIX + "job:" + job_id)
        return [_decode(raw) for raw in pipe.execute() if raw]

    # ---- jobs ---------------------------------------------------------------------------
    def create_job(self, job_id: str, run_id: str, kind: str, **extra) -> None:
        pipe = self.r.pipeline()
        pipe.hset(
            PREFIX + "job:" + job_id,
            mapping=_encode(
                {"job_id": job_id, "run_id": run_id, "kind": kind, "state": "queued", "queued_at": time.time(), **extra}
            ),
        )
        pipe.rpush(PREFIX + "run:" + run_id + ":jobs", job_id)
        pipe.execute()

    def job_started(self, job_id: str, node: str) -> None:
        """The job's first attempt began (a retry only moves it to its new node: job_attempt)."""
        self.r.hset(
            PREFIX + "job:" + job_id,
            mapping=_encode({"state": "running", "started_at": time.time(), "node": node, "attempts": 1}),
        )

    def job_attempt(self, job_id: str, node: str) -> None:
        self.r.hset(PREFIX + "job:" + job_id, "node", node)

    def job_retrying(self, job_id: str, task: str, code: str, error: str) -> None:
        """A transient failure will be retried: the job stays running, one attempt more."""
        key = PREFIX + "job:" + job_id
        pipe = self.r.pipeline()
        pipe.hincrby(key, "attempts", 1)
        pipe.hset(key, mapping={"retry_code": code, "retry_error": failures.cap(error)})
        pipe.hincrby(RETRY_COUNTS, f"{task}|{code}", 1)
        pipe.execute()

    def job_finished(
        self, job_id: str, result=None, error: str = "", code: str = "", counted: bool = True, **extra
    ) -> None:
        """End a job. A failure (an error) carries its code and retryable, and is counted by
        code for /metrics unless `counted` is false (a step skipped for another's failure)."""
        state = "failed" if error else "succeeded"
        fields = {"state": state, "finished_at": time.time(), "result": result, "error": failures.cap(error), **extra}
        if error:
            code = code or "INTERNAL"
            fields.update(failures.fields(code))
        pipe = self.r.pipeline()
        pipe.hset(PREFIX + "job:" + job_id, mapping=_encode(fields))
        if error and counted:
            pipe.hincrby(FAILURE_COUNTS, code, 1)
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
                self.job_finished(job_id, error=reason, code="RUN_CLOSED")
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
            if job and job.get("state") == "running" and self._abandoned(job):
                self.fail_lost_job(job_id, f"worker {job['node']} was lost while running this job")

    def _abandoned(self, job: dict) -> bool:
        """The job's worker process is dead and no worker of its host is left to recover it
        (jobs/lost_jobs.py retries what it can): the fallback for a host that is gone."""
        token, node = job.get("worker"), job.get("node") or ""
        if not token:  # recorded before the step's process was known
            return bool(node) and not self.node_alive(node)
        if self.worker_alive(token) or self.host_watched(node.rpartition("@")[2]):
            return False
        return self.take_lost_job(token, job["job_id"])

    # ---- failure and retry counters (read by /metrics) -----------------------------------
    def failure_counts(self) -> dict[str, int]:
        return {code: int(n) for code, n in self.r.hgetall(FAILURE_COUNTS).items()}

    def retry_counts(self) -> dict[tuple[str, str], int]:
        """(task name, reason code) -> retries."""
        return {tuple(key.split("|", 1)): int(n) for key, n in self.r.hgetall(RETRY_COUNTS).items() if "|" in key}

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
    def warm_reserve(self, warm_id: str, ttl: float) -> None:
        """Claim a warm id before its container exists, so a sweep during the start spares
        it; warm_push makes the claim permanent, a start that dies lets it expire."""
        self.r.set(PREFIX + "warmid:" + warm_id, "starting", ex=max(1, int(ttl)))

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
        """Still wanted: pooled, or claimed by a run not yet closed (a start whose worker died
        after claiming leaves a claim that no teardown removes: it goes once the run closes)."""
        owner = self.r.get(PREFIX + "warmid:" + warm_id)
        if owner is None or not owner.startswith("run-"):
            return owner is not None
        return self.r.hget(PREFIX + "run:" + owner, "state") not in (None, "closed")

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

    # ---- worker processes and the jobs they run (jobs/lost_jobs.py) ----------------------
    # A worker process is known by a random token, new for every process, so a restarted
    # worker that gets its predecessor's node name is still told apart from it.
    def worker_beat(self, host: str, token: str, facts: dict) -> None:
        """A worker process is alive (for NODE_TTL seconds); facts say how to check its pid."""
        pipe = self.r.pipeline()
        pipe.set(PREFIX + "worker:" + token, facts.get("node", ""), ex=NODE_TTL)
        pipe.hset(f"{PREFIX}host:{host}:workers", token, json.dumps(facts))
        pipe.execute()

    def worker_alive(self, token: str) -> bool:
        return bool(self.r.exists(PREFIX + "worker:" + token))

    def worker_stopped(self, token: str) -> None:
        """A worker process that shuts down cleanly is dead at once, not NODE_TTL later."""
        self.r.delete(PREFIX + "worker:" + token)

    def host_workers(self, host: str) -> dict[str, dict]:
        return {token: json.loads(facts) for token, facts in self.r.hgetall(f"{PREFIX}host:{host}:workers").items()}

    def forget_worker(self, host: str, token: str) -> None:
        pipe = self.r.pipeline()
        pipe.hdel(f"{PREFIX}host:{host}:workers", token)
        pipe.delete(PREFIX + "worker:" + token, f"{PREFIX}worker:{token}:jobs")
        pipe.execute()

    def job_running_on(self, job_id: str, token: str, node: str, retry_with: dict | None = None) -> None:
        """A worker process begins a step of the job; retry_with is how to send that step again."""
        fields = {"node": node, "worker": token}
        if retry_with is not None:
            fields["retry_with"] = json.dumps(retry_with)
        pipe = self.r.pipeline()
        pipe.hset(PREFIX + "job:" + job_id, mapping=fields)
        pipe.sadd(f"{PREFIX}worker:{token}:jobs", job_id)
        pipe.execute()

    def job_left(self, job_id: str, token: str) -> None:
        """The step has returned (whatever its outcome): its process no longer holds the job."""
        self.r.srem(f"{PREFIX}worker:{token}:jobs", job_id)

    def worker_jobs(self, token: str) -> list[str]:
        return list(self.r.smembers(f"{PREFIX}worker:{token}:jobs"))

    def take_lost_job(self, token: str, job_id: str) -> bool:
        """True for exactly one caller: whoever removes the job from its dead process's set."""
        return bool(self.r.srem(f"{PREFIX}worker:{token}:jobs", job_id))

    def job_lost_retry(self, job_id: str, task: str, error: str) -> int:
        """A lost step is sent again: one attempt more (the first counts as 1), counted for
        /metrics as a retry of `task` for WORKER_LOST; returns the attempt."""
        key = PREFIX + "job:" + job_id
        pipe = self.r.pipeline()
        pipe.hsetnx(key, "attempts", 1)
        pipe.hincrby(key, "attempts", 1)
        pipe.hset(key, mapping={"retry_code": "WORKER_LOST", "retry_error": error})
        pipe.hincrby(RETRY_COUNTS, f"{task}|WORKER_LOST", 1)
        return pipe.execute()[1]

    def fail_lost_job(self, job_id: str, error: str, code: str = "WORKER_LOST") -> bool:
        """End a job whose process died, unless it ended meanwhile; True when this call ended it."""
        if self.job_state(job_id) not in ("queued", "running"):
            return False
        self.job_finished(job_id, error=error, code=code)
        return True

    def host_watched(self, host: str) -> bool:
        """Some worker process of the host beat within NODE_TTL: its lost-job scan is running."""
        score = self.r.zscore(PREFIX + "hosts", host)
        return score is not None and score > time.time() - NODE_TTL


# ---- locks ----------------------------------------------------------------------------------
LOCK_TTL = 12.0  # a lock outlives its owner by at most this long: the owner renews it meanwhile
LOCK_POLL = 0.2
_BREAK_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class OwnedLock:
    """A Redis lock that lives only while its owner keeps renewing it.

    The value names the owner process (processes.owner_token); a daemon thread of the owner
    renews the TTL every third of it. A waiter takes the lock of an owner that died within
    LOCK_TTL seconds, and at once when it can tell from the pid that the owner is gone.
    """

    def __init__(self, client: redis.Redis, name: str, ttl: float = LOCK_TTL):
        self.name = name
        self._client = client
        self._ttl = ttl
        # Not thread-local: the renewing thread must see the owner's token.
        self._lock = client.lock(name, timeout=ttl, thread_local=False)
        self._break = client.register_script(_BREAK_LOCK)
        self._stop = threading.Event()

    def acquire(self, wait: float = 0) -> bool:
        """Take the lock, waiting up to `wait` seconds for it (0: do not wait)."""
        token = processes.owner_token()
        deadline = time.monotonic() + wait
        while not self._lock.acquire(blocking=False, token=token):
            holder = self.owner()
            if holder and processes.owner_dead(holder):
                log.warning("lock %s: its owner %s is gone; taking it over", self.name, holder)
                self._break(keys=[self.name], args=[holder])
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(LOCK_POLL, max(deadline - time.monotonic(), 0)))
        self._stop = threading.Event()  # one per holding: a late renewer of an earlier one stops
        threading.Thread(target=self._renew, args=(self._stop,), daemon=True, name=f"renew {self.name}").start()
        return True

    def owner(self) -> str:
        value = self._client.get(self.name)
        return value.decode() if isinstance(value, bytes) else (value or "")

    def release(self) -> None:
        self._stop.set()
        try:
            self._lock.release()
        except redis.exceptions.LockError:
            pass  # expired meanwhile (the owner stalled past its TTL): nothing to release

    def __enter__(self) -> OwnedLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self._ttl / 3):
            try:
                self._lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                if not stop.is_set():
                    log.warning("lock %s was lost (its TTL ran out before a renewal)", self.name)
                return
            except redis.exceptions.RedisError:
                log.warning("renewing lock %s failed; retrying", self.name, exc_info=True)


def build_lock(client: redis.Redis, host: str, image: str) -> OwnedLock:
    """One build of an image per host at a time."""
    return OwnedLock(client, f"{PREFIX}build-lock:{host}:{image}")


def warm_lock(client: redis.Redis, host: str, task_path: str) -> OwnedLock:
    """One refill of a task's warm pool per host at a time."""
    return OwnedLock(client, f"{PREFIX}warm-lock:{host}:{task_path}")
