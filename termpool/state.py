"""Run, lease and job state in Redis: the one module both the facade and the workers use.

The only code that builds a Redis key or holds a Redis client: everything else asks a `Store`.
Every key termpool writes starts with PREFIX and is built by one function below (the Lua
scripts get the prefix and TTLs as arguments and build the same run and host keys):

  run:<id>                   hash: the run record (JSON for structured fields)
  run:<id>:jobs              list: job ids of the run, oldest first
  runs:recent                zset: run ids by creation time, newest RECENT_RUNS_KEPT (run viewer)
  req:<task key>:<request>   string, IDEMPOTENCY_TTL: run id of an idempotent allocate
  host:<h>:keys              hash: task_key -> live runs of that key on host h (capacity)
  host:<h>:live              zset: live run ids on host h, scored by last use (reaper)
  host:<h>:closing           set: runs released but not yet torn down
  host:<h>:workers           hash: token -> JSON facts of the worker processes of host h
  host:<h>:nodes             hash: worker node -> "<queue kind> <last beat>" (0: stopped cleanly)
  host:<h>:info              hash: what host h publishes with its heartbeat (its capacity)
  host:<h>:lost              set: runs of h marked lost (HOST_LOST) until h's reconcile closes them
  hosts                      zset: worker hosts, scored by their last heartbeat
  hosts:draining             set: hosts that take no new runs
  images:<h>                 set: task paths whose images host h has built
  job:<id>                   hash: a job record
  job:<id>:done              list, non-empty once the job ended (wakes wait_job)
  episode:<start job>        list: an episode's job ids in chain order
  node:<name>                string, NODE_TTL: a worker process (by node name) is alive
  worker:<token>             string, NODE_TTL: one worker process (incarnation) is alive
  worker:<token>:jobs        set: jobs that worker process is running now (lost if it dies)
  sess:<run>                 set: the run's shell session ids
  sess:<run>:<sid>           hash: read offset and kind of a shell session
  warm:<h>:<task path>       list: pre-started warm containers (JSON entries), LPOP claims one
  warmid:<id>                string: a warm container is still wanted ("starting" with a
                             TTL, "pooled", or the run that claimed it)
  warm-starting:<h>:<task>   zset: warm ids being started, scored by when their claim lapses
  warm-demand:<h>:<task>     zset: recent resets of the task on h (run ids by time), trimmed
                             to WARM_DEMAND_WINDOW: what sizes the pool
  warm-facts:<h>:<task>      hash: task name, measured spare start seconds and idle bytes
  warm-tasks:<h>             set: task paths with a pool, starts or recent demand on h
  warm-counts:<h>            hash: warm pool counters (claimed, missed, started, start and CPU
                             seconds, trimmed, expired, drained) for the benchmark
  build-lock:<h>:<image>     string, LOCK_TTL renewed: one build of an image per host
  beat-lock                  string, LOCK_TTL renewed: one beat scheduler per deployment
  count:failures             hash: failure code -> failed jobs (for /metrics)
  count:retries              hash: "<task>|<reason code>" -> automatic retries (for /metrics)
  monitor                    string, a short TTL renewed: a monitor (Flower) listens for task
                             events (jobs/flower.py; termpool/queues.py follow_monitor)

Closed runs and ended jobs expire RECORD_TTL after they end. The same Redis is Celery's broker:
its queues (``termpool.<host>.<kind>``, termpool/queues.py) and kombu's own keys belong to kombu.
termpool only reads a queue's depth: the LLEN of the list named after the queue, which Celery
documents as its length, and which holds every message because termpool/queues.py gives the
transport one priority step (Store.queue_depths).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass

import redis

from termpool import failures, processes

log = logging.getLogger(__name__)

PREFIX = "tp:"
IDEMPOTENCY_TTL = 300  # seconds a request id keeps naming its run
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
RECENT_RUNS_KEPT = 5000
UNAVAILABLE = redis.exceptions.RedisError  # what a reader meets when Redis is away or refuses


# ---- keys (the families of the module docstring) -------------------------------------------
FAILURE_COUNTS = PREFIX + "count:failures"
RETRY_COUNTS = PREFIX + "count:retries"
RECENT_RUNS = PREFIX + "runs:recent"  # and in the placement script
HOSTS = PREFIX + "hosts"
MONITOR = PREFIX + "monitor"


def run_key(run_id: str) -> str:
    return f"{PREFIX}run:{run_id}"  # the Lua scripts build this one too


def run_jobs_key(run_id: str) -> str:
    return f"{PREFIX}run:{run_id}:jobs"


def request_key(task_key: str, request_id: str) -> str:
    return f"{PREFIX}req:{task_key}:{request_id}"


def host_tasks_key(host: str) -> str:
    return f"{PREFIX}host:{host}:keys"  # and in the Lua scripts


def host_live_key(host: str) -> str:
    return f"{PREFIX}host:{host}:live"  # and in the Lua scripts


def host_closing_key(host: str) -> str:
    return f"{PREFIX}host:{host}:closing"  # and in the Lua scripts


def host_workers_key(host: str) -> str:
    return f"{PREFIX}host:{host}:workers"


def images_key(host: str) -> str:
    return f"{PREFIX}images:{host}"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_done_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:done"


def episode_key(start_job: str) -> str:
    return f"{PREFIX}episode:{start_job}"


def node_key(node: str) -> str:
    return f"{PREFIX}node:{node}"


def worker_key(token: str) -> str:
    return f"{PREFIX}worker:{token}"


def worker_jobs_key(token: str) -> str:
    return f"{PREFIX}worker:{token}:jobs"


def sessions_key(run_id: str) -> str:
    return f"{PREFIX}sess:{run_id}"


def session_key(run_id: str, sid: str) -> str:
    return f"{PREFIX}sess:{run_id}:{sid}"


def warm_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm:{host}:{task_path}"


def warm_id_key(warm_id: str) -> str:
    return f"{PREFIX}warmid:{warm_id}"


def warm_starting_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm-starting:{host}:{task_path}"


def warm_demand_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm-demand:{host}:{task_path}"


def warm_facts_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm-facts:{host}:{task_path}"


def warm_tasks_key(host: str) -> str:
    return f"{PREFIX}warm-tasks:{host}"


def warm_counts_key(host: str) -> str:
    return f"{PREFIX}warm-counts:{host}"


def build_lock_key(host: str, image: str) -> str:
    return f"{PREFIX}build-lock:{host}:{image}"


def host_nodes_key(host: str) -> str:
    return f"{PREFIX}host:{host}:nodes"  # and in the placement script


def host_info_key(host: str) -> str:
    return f"{PREFIX}host:{host}:info"  # and in the placement script


def host_lost_key(host: str) -> str:
    return f"{PREFIX}host:{host}:lost"  # and in the host-lost script


DRAINING = PREFIX + "hosts:draining"  # and in the placement script
BEAT_LOCK = PREFIX + "beat-lock"
LOCK_PATTERNS = (PREFIX + "build-lock:*",)


class CapacityError(Exception):
    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


class UnknownRun(KeyError):
    pass


# The scripts build run:<id> and host:<h>:{keys,live,closing} from the prefix they are given.
_RELEASE = """
local prefix, run_id = ARGV[1], ARGV[2]
local run_key = prefix .. 'run:' .. run_id
local state = redis.call('HGET', run_key, 'state')
if not state or state == 'closing' or state == 'closed' then return false end
if ARGV[5] ~= '' and state ~= ARGV[5] then return false end
local host, task_key = redis.call('HGET', run_key, 'host'), redis.call('HGET', run_key, 'task_key')
if state == 'lost' then  -- it left its host's capacity when the host was lost
  redis.call('SREM', prefix .. 'host:' .. host .. ':lost', run_id)
else
  local keys_key = prefix .. 'host:' .. host .. ':keys'
  if redis.call('HINCRBY', keys_key, task_key, -1) <= 0 then redis.call('HDEL', keys_key, task_key) end
  redis.call('ZREM', prefix .. 'host:' .. host .. ':live', run_id)
end
redis.call('SADD', prefix .. 'host:' .. host .. ':closing', run_id)
redis.call('HSET', run_key, 'state', 'closing', 'closing_reason', ARGV[3], 'last_used_at', ARGV[4])
return host
"""


# A live run's record, marked as used; with ARGV[4] == 'busy' also marked busy when it was
# ready (a tool call begins). The record is returned as it was.
_USE_RUN = """
local run_key, now = KEYS[1], ARGV[2]
local state = redis.call('HGET', run_key, 'state')
if not state or state == 'closing' or state == 'closed' then return false end
redis.call('HSET', run_key, 'last_used_at', now)
local host = redis.call('HGET', run_key, 'host')
if host then redis.call('ZADD', ARGV[1] .. 'host:' .. host .. ':live', 'XX', now, ARGV[3]) end
local record = redis.call('HGETALL', run_key)
if ARGV[4] == 'busy' and (state == 'ready' or state == 'evaluated') then
  redis.call('HSET', run_key, 'state', 'busy')
end
return record
"""

# A worker process takes a job's message: a queued job starts (its first attempt); unless the
# job is settled already, it is listed under the process (lost_jobs) with its node and, when
# it may be sent again after the process dies, how (retry_with).
_BEGIN_JOB = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'succeeded' or state == 'failed' then return state end
if state == 'queued' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[1], 'attempts', 1)
end
redis.call('HSET', KEYS[1], 'node', ARGV[2], 'worker', ARGV[3])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'retry_with', ARGV[4]) end
redis.call('SADD', KEYS[2], ARGV[5])
return state
"""

_SET_IF_LIVE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'closing' or state == 'closed' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
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
        self._r = client
        self._release = client.register_script(_RELEASE)
        self._transition = client.register_script(_TRANSITION)
        self._set_if_live = client.register_script(_SET_IF_LIVE)
        self._use_run = client.register_script(_USE_RUN)
        self._begin_job = client.register_script(_BEGIN_JOB)
        self._redis_started: tuple[float, float] | None = None  # (read at, Redis start), monotonic

    @classmethod
    def from_url(cls, url: str, timeout: float = 30) -> Store:
        """A store on its own client. The socket timeout must exceed wait_job's polls of a few
        seconds (readers that never block, like /metrics, pass a short one)."""
        return cls(
            redis.Redis.from_url(
                url,
                decode_responses=True,
                health_check_interval=30,
                socket_timeout=timeout,
                socket_connect_timeout=min(5, timeout),
            )
        )

    def ping(self) -> bool:
        return bool(self._r.ping())

    # ---- worker hosts -------------------------------------------------------------------
    def live_hosts(self) -> list[str]:
        return self._r.zrangebyscore(HOSTS, time.time() - HOST_ALIVE_SECONDS, "+inf")

    def node_heartbeat(self, node: str) -> None:
        self._r.set(node_key(node), "1", ex=NODE_TTL)

    def node_alive(self, node: str) -> bool:
        return bool(self._r.exists(node_key(node)))

    # ---- runs ---------------------------------------------------------------------------
    def get_run(self, run_id: str) -> dict | None:
        raw = self._r.hgetall(run_key(run_id)) if run_id else {}
        return _decode(raw) if raw else None

    def require_run(self, run_id: str) -> dict:
        run = self.get_run(run_id)
        if run is None:
            raise UnknownRun(run_id)
        return run

    def update_run(self, run_id: str, **fields) -> None:
        if fields:
            self._r.hset(run_key(run_id), mapping=_encode(fields))

    def touch(self, run_id: str) -> bool:
        """Record use of a live run; False when the lease is unknown or released."""
        key = run_key(run_id)
        state, host = self._r.hmget(key, "state", "host")
        if state is None or state in ("closing", "closed"):
            return False
        now = time.time()
        pipe = self._r.pipeline()
        pipe.hset(key, "last_used_at", now)
        pipe.zadd(host_live_key(host), {run_id: now}, xx=True)
        pipe.execute()
        return True

    def use_run(self, run_id: str, busy: bool = False) -> dict | None:
        """A live run's record, marked as used (touch) in the same round trip; None when the
        lease is unknown or released. With busy, a ready run is also marked busy (a tool call
        begins); the record is returned as it was."""
        if not run_id:
            return None
        raw = self._use_run(keys=[run_key(run_id)], args=[PREFIX, time.time(), run_id, "busy" if busy else ""])
        return _decode(dict(zip(raw[::2], raw[1::2]))) if raw else None

    def set_state_if_live(self, run_id: str, state: str, **fields) -> bool:
        """Change a run's state unless it has been released meanwhile (close wins): one
        atomic round trip, so a close landing between the check and the write cannot be undone."""
        flat = [item for pair in _encode({"state": state, **fields}).items() for item in pair]
        return bool(self._set_if_live(keys=[run_key(run_id)], args=flat))

    def transition(self, run_id: str, from_states: tuple, to_state: str) -> bool:
        """Atomically move a run to to_state only if it is in one of from_states."""
        return bool(self._transition(keys=[run_key(run_id)], args=[to_state, *from_states]))

    def release(self, run_id: str, reason: str = "closed", only_state: str = "") -> bool:
        """Free the run's capacity slot and mark it closing; False if already released (or,
        with only_state, when the run is no longer in that state)."""
        return self.release_on_host(run_id, reason, only_state) is not None

    def release_on_host(self, run_id: str, reason: str = "closed", only_state: str = "") -> str | None:
        """release() in one round trip, returning the run's host (None when nothing was
        released). A lost run, already out of its host's capacity, becomes closing too: its
        teardown waits in its host's queue."""
        return self._release(args=[PREFIX, run_id, reason, time.time(), only_state]) or None

    def mark_closed(self, run_id: str, error: str = "") -> None:
        host = self._r.hget(run_key(run_id), "host")
        pipe = self._r.pipeline()
        pipe.hset(run_key(run_id), mapping=_encode({"state": "closed", "closed_at": time.time()}))
        if error:
            pipe.hset(run_key(run_id), "teardown_error", error)
        if host:
            pipe.srem(host_closing_key(host), run_id)
        pipe.expire(run_key(run_id), RECORD_TTL)
        pipe.expire(run_jobs_key(run_id), RECORD_TTL)
        pipe.execute()
        self.drop_sessions(run_id)

    def idle_runs(self, host: str, idle_ttl: float) -> list[str]:
        return self._r.zrangebyscore(host_live_key(host), "-inf", time.time() - idle_ttl)

    def never_reset_runs(self, host: str, older_than: float) -> list[str]:
        """Runs allocated more than older_than seconds ago that were never reset or started."""
        runs = self.live_runs(host)
        if not runs:
            return []
        pipe = self._r.pipeline()
        for run_id in runs:
            pipe.hmget(run_key(run_id), "state", "created_at", "start_job")
        cutoff = time.time() - older_than
        return [
            run_id
            for run_id, (state, created, start_job) in zip(runs, pipe.execute())
            if state == "allocated" and not start_job and created is not None and float(created) < cutoff
        ]

    def live_runs(self, host: str) -> list[str]:
        return self._r.zrange(host_live_key(host), 0, -1)

    def closing_runs(self, host: str) -> list[str]:
        return list(self._r.smembers(host_closing_key(host)))

    def stale_closing_runs(self, host: str, older_than: float) -> list[str]:
        """Runs released more than older_than seconds ago whose teardown has not ended."""
        runs = self.closing_runs(host)
        if not runs:
            return []
        pipe = self._r.pipeline()
        for run_id in runs:
            pipe.hget(run_key(run_id), "last_used_at")
        cutoff = time.time() - older_than
        return [run_id for run_id, at in zip(runs, pipe.execute()) if at is None or float(at) < cutoff]

    def host_status(self, host: str) -> dict:
        keys = self._r.hgetall(host_tasks_key(host))
        return {
            "active_tasks": len(keys),
            "total_active_runs": sum(int(v) for v in keys.values()),
            "pending_closes": self._r.scard(host_closing_key(host)),
            "tasks": {key: {"active_runs": int(n)} for key, n in sorted(keys.items())},
        }

    # ---- recent runs (the run viewer) ------------------------------------------------------
    def recent_runs(self, fields: tuple, count: int, before: float | None = None) -> tuple[list[dict], float | None]:
        """Up to `count` indexed runs created before `before` (all when None), newest first,
        with the given fields of their records; and where to continue (None at the end).
        Ids whose record has expired are dropped from the index."""
        upper = "+inf" if before is None else f"({before!r}"
        page = self._r.zrevrangebyscore(RECENT_RUNS, upper, "-inf", start=0, num=count, withscores=True)
        pipe = self._r.pipeline()
        for run_id, _ in page:
            pipe.hmget(run_key(run_id), "state", *fields)
        runs, gone = [], []
        for (run_id, _), values in zip(page, pipe.execute()):
            if values[0] is None:
                gone.append(run_id)
                continue
            found = {field: value for field, value in zip(("state", *fields), values) if value is not None}
            runs.append(_decode({**found, "run_id": run_id}))
        if gone:
            self._r.zrem(RECENT_RUNS, *gone)
        return runs, (page[-1][1] if len(page) == count else None)

    def first_jobs(self, run_ids: list[str], fields: tuple) -> dict[str, dict]:
        """The first job of each run (its start job, if it was ever started), by run id."""
        pipe = self._r.pipeline()
        for run_id in run_ids:
            pipe.lindex(run_jobs_key(run_id), 0)
        job_ids = dict(zip(run_ids, pipe.execute()))
        pipe = self._r.pipeline()
        for job_id in filter(None, job_ids.values()):
            pipe.hmget(job_key(job_id), "kind", *fields)
        values = iter(pipe.execute())
        jobs = {}
        for run_id, job_id in job_ids.items():
            if job_id:
                record = dict(zip(("kind", *fields), next(values)))
                jobs[run_id] = _decode({k: v for k, v in record.items() if v is not None} | {"job_id": job_id})
        return jobs

    def get_jobs(self, job_ids: list[str]) -> list[dict]:
        """Several job records in one round trip, in order; expired ones are left out."""
        pipe = self._r.pipeline()
        for job_id in job_ids:
            pipe.hgetall(job_key(job_id))
        return [_decode(raw) for raw in pipe.execute() if raw]

    # ---- jobs ---------------------------------------------------------------------------
    def create_job(self, job_id: str, run_id: str, kind: str, **extra) -> None:
        pipe = self._r.pipeline()
        pipe.hset(
            job_key(job_id),
            mapping=_encode(
                {"job_id": job_id, "run_id": run_id, "kind": kind, "state": "queued", "queued_at": time.time(), **extra}
            ),
        )
        pipe.rpush(run_jobs_key(run_id), job_id)
        pipe.execute()

    def begin_job(self, job_id: str, node: str, token: str = "", retry_with: dict | None = None) -> str | None:
        """A job's message is being run by worker process `token` on `node`: returns the job's
        state before. A queued job is now running, its first attempt; a retry only moves it to
        its new node. Unless it was settled already, the job is listed under the process
        (lost_jobs) until job_left or job_finished(..., worker=token). One round trip."""
        encoded = json.dumps(retry_with) if retry_with is not None else ""
        return self._begin_job(
            keys=[job_key(job_id), worker_jobs_key(token)], args=[time.time(), node, token, encoded, job_id]
        )

    def job_retrying(self, job_id: str, task: str, code: str, error: str) -> None:
        """A transient failure will be retried: the job stays running, one attempt more."""
        key = job_key(job_id)
        pipe = self._r.pipeline()
        pipe.hincrby(key, "attempts", 1)
        pipe.hset(key, mapping={"retry_code": code, "retry_error": failures.cap(error)})
        pipe.hincrby(RETRY_COUNTS, f"{task}|{code}", 1)
        pipe.execute()

    def job_finished(
        self,
        job_id: str,
        result=None,
        error: str = "",
        code: str = "",
        counted: bool = True,
        worker: str = "",
        ready_run: str = "",
        **extra,
    ) -> None:
        """End a job. A failure (an error) carries its code and retryable, and is counted by
        code for /metrics unless `counted` is false (a step skipped for another's failure).
        With `worker`, the job also leaves that process's list (job_left); with `ready_run`,
        that run goes from busy back to ready (a tool call ended), before anyone waiting on
        the job wakes; all in the same round trip."""
        state = "failed" if error else "succeeded"
        fields = {"state": state, "finished_at": time.time(), "result": result, "error": failures.cap(error), **extra}
        if error:
            code = code or "INTERNAL"
            fields.update(failures.fields(code))
        pipe = self._r.pipeline()
        if ready_run:
            self._transition(keys=[run_key(ready_run)], args=["ready", "busy"], client=pipe)
        pipe.hset(job_key(job_id), mapping=_encode(fields))
        if error and counted:
            pipe.hincrby(FAILURE_COUNTS, code, 1)
        pipe.rpush(job_done_key(job_id), state)
        pipe.expire(job_key(job_id), RECORD_TTL)
        pipe.expire(job_done_key(job_id), RECORD_TTL)
        if worker:
            pipe.srem(worker_jobs_key(worker), job_id)
        pipe.execute()

    def job_state(self, job_id: str) -> str | None:
        return self._r.hget(job_key(job_id), "state")

    def get_job(self, job_id: str) -> dict | None:
        raw = self._r.hgetall(job_key(job_id)) if job_id else {}
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
        return bool(self._r.hsetnx(run_key(run_id), "start_job", job_id))

    def start_job(self, run_id: str) -> str | None:
        return self._r.hget(run_key(run_id), "start_job")

    def set_episode_jobs(self, start_job: str, job_ids: list[str]) -> None:
        """An episode's job ids in chain order, for its error callback."""
        key = episode_key(start_job)
        pipe = self._r.pipeline()
        pipe.rpush(key, *job_ids)
        pipe.expire(key, RECORD_TTL)
        pipe.execute()

    def episode_jobs(self, start_job: str) -> list[str]:
        return self._r.lrange(episode_key(start_job), 0, -1)

    def run_jobs(self, run_id: str) -> list[str]:
        return self._r.lrange(run_jobs_key(run_id), 0, -1)

    def wait_job(self, job_id: str, timeout: float | None, poll: float = 5.0) -> dict | None:
        """Block until the job has ended (or timeout seconds pass); return its record.

        BLMOVE of the done list onto itself wakes every waiter without consuming the
        signal; the record is read in the same round trip (Redis runs a connection's
        pipelined commands in order, so the read waits for the wake-up). Between wake-ups
        it checks that the worker running the job is alive, so a killed worker fails the
        job instead of hanging the client forever.
        """
        done_key = job_done_key(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = poll if deadline is None else min(poll, deadline - time.monotonic())
            if left <= 0:
                return self.get_job(job_id)
            pipe = self._r.pipeline(transaction=False)
            pipe.blmove(done_key, done_key, max(left, 0.01), "LEFT", "RIGHT")
            pipe.hgetall(job_key(job_id))
            ended, raw = pipe.execute()
            job = _decode(raw) if raw else None
            if ended is not None:
                return job
            if job and job.get("state") == "running" and self._abandoned(job):
                # With its process known, a job is abandoned only when its whole host is silent.
                code = "HOST_LOST" if job.get("worker") else "WORKER_LOST"
                self.fail_lost_job(job_id, f"worker {job['node']} was lost while running this job", code=code)

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
        return {code: int(n) for code, n in self._r.hgetall(FAILURE_COUNTS).items()}

    def retry_counts(self) -> dict[tuple[str, str], int]:
        """(task name, reason code) -> retries."""
        return {tuple(key.split("|", 1)): int(n) for key, n in self._r.hgetall(RETRY_COUNTS).items() if "|" in key}

    # ---- task images --------------------------------------------------------------------
    def mark_image_ready(self, host: str, task_path: str, ready: bool = True) -> None:
        key = images_key(host)
        if ready:
            self._r.sadd(key, task_path)
        else:
            self._r.srem(key, task_path)

    def image_ready(self, host: str, task_path: str) -> bool:
        return bool(self._r.sismember(images_key(host), task_path))

    # ---- warm pool (jobs/warm_pool.py) ------------------------------------------------------
    # tp:warm:<host>:<task_path> lists pre-started containers (JSON entries, oldest first); LPOP
    # hands each to exactly one run. tp:warmid:<id> says the warm container is still wanted
    # ("starting", "pooled" or the run that claimed it), so the reconcile sweep leaves it alone.
    def warm_note_reset(self, host: str, pool: str, run_id: str, task_name: str, claimed: bool, window: float):
        """A reset of the task on this host (served from the pool or not): the pool's demand."""
        now = time.time()
        demand = warm_demand_key(host, pool)
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(demand, {f"{run_id} {now}": now})
        pipe.zremrangebyscore(demand, "-inf", now - window)
        pipe.expire(demand, max(1, math.ceil(window)))
        pipe.sadd(warm_tasks_key(host), pool)
        pipe.hset(warm_facts_key(host, pool), "task_name", task_name)
        pipe.hincrby(warm_counts_key(host), "claimed" if claimed else "missed", 1)
        pipe.execute()

    def warm_resets(self, host: str, pool: str, window: float) -> list[float]:
        """Times of the task's resets on this host within the last `window` seconds."""
        since = time.time() - window
        return [at for _, at in self._r.zrangebyscore(warm_demand_key(host, pool), since, "+inf", withscores=True)]

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
            keys=[warm_key(host, pool), warm_starting_key(host, pool)],
            args=[now, now + ttl, target, at_once, *candidates],
        )
        if ids:
            pipe = self._r.pipeline(transaction=False)
            for warm_id in ids:
                pipe.set(warm_id_key(warm_id), "starting", ex=max(1, int(ttl)))
            pipe.execute()
        return ids

    def warm_take_starting(self, host: str, pool: str) -> list[str]:
        """Every start reservation of the task on this host, taken back: for a lifecycle worker
        that starts or stops cleanly, as none of them is being started then (one lifecycle
        worker per host)."""
        key = warm_starting_key(host, pool)
        pipe = self._r.pipeline()
        pipe.zrange(key, 0, -1)
        pipe.delete(key)
        ids = pipe.execute()[0]
        if ids:
            self._r.delete(*[warm_id_key(warm_id) for warm_id in ids])
        return ids

    def warm_unreserve(self, host: str, pool: str, warm_id: str) -> None:
        """A start that failed: its claim goes (its container, if any, is removed by the caller)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zrem(warm_starting_key(host, pool), warm_id)
        pipe.delete(warm_id_key(warm_id))
        pipe.execute()

    def warm_push(self, host: str, pool: str, entry: dict) -> None:
        entry = {"pushed_at": time.time(), **entry}
        pipe = self._r.pipeline()
        pipe.set(warm_id_key(entry["warm_id"]), "pooled")
        pipe.rpush(warm_key(host, pool), json.dumps(entry))
        pipe.zrem(warm_starting_key(host, pool), entry["warm_id"])
        pipe.sadd(warm_tasks_key(host), pool)
        pipe.execute()

    def warm_claim(self, host: str, pool: str, run_id: str) -> dict | None:
        raw = self._r.lpop(warm_key(host, pool))
        if raw is None:
            return None
        entry = json.loads(raw)
        self._r.set(warm_id_key(entry["warm_id"]), run_id)
        return entry

    def warm_trim(self, host: str, pool: str, keep: int, cutoff: float) -> list[dict]:
        """Take out of the pool (oldest first) the spares beyond `keep` and those pooled before
        `cutoff`; they are no longer wanted (a sweep removes any its caller does not)."""
        raw = self._warm_trim(keys=[warm_key(host, pool)], args=[keep, cutoff, warm_id_key("")])
        return [json.loads(entry) for entry in raw]

    def warm_count(self, host: str, pool: str) -> int:
        return self._r.llen(warm_key(host, pool))

    def warm_starting(self, host: str, pool: str) -> int:
        return self._r.zcount(warm_starting_key(host, pool), time.time(), "+inf")

    def warm_tasks(self, host: str) -> set[str]:
        return self._r.smembers(warm_tasks_key(host))

    def warm_pools(self, host: str) -> dict[str, list[dict]]:
        """Every pool of the host: task path -> its pooled entries."""
        pools = sorted(self.warm_tasks(host))
        pipe = self._r.pipeline(transaction=False)
        for pool in pools:
            pipe.lrange(warm_key(host, pool), 0, -1)
        return {pool: [json.loads(e) for e in raw] for pool, raw in zip(pools, pipe.execute())}

    def warm_forget_task(self, host: str, pool: str, window: float) -> bool:
        """Stop looking after a task with no spares, no starts and no reset in `window` seconds."""
        keys = [warm_tasks_key(host), warm_key(host, pool), warm_starting_key(host, pool), warm_demand_key(host, pool)]
        now = time.time()
        return bool(self._warm_forget_task(keys=keys, args=[pool, now, now - window]))

    def warm_facts(self, host: str, pool: str) -> dict:
        """task_name, start_s and idle_bytes (the measured ones as numbers) of the task's spares."""
        facts = self._r.hgetall(warm_facts_key(host, pool))
        for name in ("start_s", "idle_bytes"):
            if name in facts:
                facts[name] = float(facts[name])
        return facts

    def warm_set_facts(self, host: str, pool: str, **facts) -> None:
        self._r.hset(warm_facts_key(host, pool), mapping={k: str(v) for k, v in facts.items()})

    def warm_count_event(self, host: str, **amounts: float) -> None:
        """Add to the host's warm pool counters (floats allowed: seconds)."""
        pipe = self._r.pipeline(transaction=False)
        for name, amount in amounts.items():
            pipe.hincrbyfloat(warm_counts_key(host), name, amount)
        pipe.execute()

    def warm_counters(self, host: str) -> dict[str, float]:
        return {name: float(value) for name, value in self._r.hgetall(warm_counts_key(host)).items()}

    def warm_known(self, warm_id: str) -> bool:
        """Still wanted: pooled, or claimed by a run not yet closed (a start whose worker died
        after claiming leaves a claim that no teardown removes: it goes once the run closes)."""
        owner = self._r.get(warm_id_key(warm_id))
        if owner is None or not owner.startswith("run-"):
            return owner is not None
        return self._r.hget(run_key(owner), "state") not in (None, "closed")

    def warm_forget(self, warm_id: str) -> None:
        self._r.delete(warm_id_key(warm_id))

    @functools.cached_property
    def _warm_reserve(self):
        return self._r.register_script(_WARM_RESERVE)

    @functools.cached_property
    def _warm_trim(self):
        return self._r.register_script(_WARM_TRIM)

    @functools.cached_property
    def _warm_forget_task(self):
        return self._r.register_script(_WARM_FORGET_TASK)

    # ---- shell sessions -----------------------------------------------------------------
    def session(self, run_id: str, sid: str) -> dict:
        return self._r.hgetall(session_key(run_id, sid))

    def update_session(self, run_id: str, sid: str, **fields) -> None:
        key = session_key(run_id, sid)
        self._r.hset(key, mapping={k: str(v) for k, v in fields.items()})
        self._r.sadd(sessions_key(run_id), sid)

    def drop_sessions(self, run_id: str) -> None:
        sids = self._r.smembers(sessions_key(run_id))
        if sids:
            self._r.delete(*[session_key(run_id, sid) for sid in sids])
        self._r.delete(sessions_key(run_id))

    # ---- worker processes and the jobs they run (jobs/lost_jobs.py) ----------------------
    # A worker process is known by a random token, new for every process, so a restarted
    # worker that gets its predecessor's node name is still told apart from it.
    def worker_beat(self, host: str, token: str, facts: dict) -> None:
        """A worker process is alive (for NODE_TTL seconds); facts say how to check its pid."""
        pipe = self._r.pipeline()
        pipe.set(worker_key(token), facts.get("node", ""), ex=NODE_TTL)
        pipe.hset(host_workers_key(host), token, json.dumps(facts))
        pipe.execute()

    def announce_monitor(self, ttl: float) -> None:
        """A monitor listens for task events for the next `ttl` seconds."""
        self._r.set(MONITOR, "1", ex=max(1, math.ceil(ttl)))

    def monitor_listening(self) -> bool:
        return bool(self._r.exists(MONITOR))

    def worker_alive(self, token: str) -> bool:
        return bool(self._r.exists(worker_key(token)))

    def worker_stopped(self, token: str) -> None:
        """A worker process that shuts down cleanly is dead at once, not NODE_TTL later."""
        self._r.delete(worker_key(token))

    def host_workers(self, host: str) -> dict[str, dict]:
        return {token: json.loads(facts) for token, facts in self._r.hgetall(host_workers_key(host)).items()}

    def forget_worker(self, host: str, token: str) -> None:
        pipe = self._r.pipeline()
        pipe.hdel(host_workers_key(host), token)
        pipe.delete(worker_key(token), worker_jobs_key(token))
        pipe.execute()

    def job_left(self, job_id: str, token: str) -> None:
        """The step has returned (whatever its outcome): its process no longer holds the job."""
        self._r.srem(worker_jobs_key(token), job_id)

    def worker_jobs(self, token: str) -> list[str]:
        return list(self._r.smembers(worker_jobs_key(token)))

    def take_lost_job(self, token: str, job_id: str) -> bool:
        """True for exactly one caller: whoever removes the job from its dead process's set."""
        return bool(self._r.srem(worker_jobs_key(token), job_id))

    def job_lost_retry(self, job_id: str, task: str, error: str) -> int:
        """A lost step is sent again: one attempt more (the first counts as 1), counted for
        /metrics as a retry of `task` for WORKER_LOST; returns the attempt."""
        key = job_key(job_id)
        pipe = self._r.pipeline()
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
        score = self._r.zscore(HOSTS, host)
        return score is not None and score > time.time() - NODE_TTL

    # ---- locks (OwnedLock below) --------------------------------------------------------
    def build_lock(self, host: str, image: str) -> OwnedLock:
        """One build of an image per host at a time."""
        return OwnedLock(self._r, build_lock_key(host, image))

    def beat_lock(self) -> OwnedLock:
        """One beat scheduler per deployment (one Redis): a second one stands by until it is free."""
        return OwnedLock(self._r, BEAT_LOCK)

    def held_locks(self) -> dict[str, float]:
        """Every build lock held now -> seconds until it expires unless renewed
        (inf for one without a TTL, which no OwnedLock leaves)."""
        names = [name for pattern in LOCK_PATTERNS for name in self._r.scan_iter(match=pattern, count=1000)]
        pipe = self._r.pipeline(transaction=False)
        for name in names:
            pipe.pttl(name)
        left = {}
        for name, ms in zip(names, pipe.execute()):
            if ms != -2:  # -2: released since the scan
                left[name] = math.inf if ms == -1 else ms / 1000
        return left

    # ---- many hosts: liveness per queue kind, placement, drain, loss (termpool/hosts.py) --------
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
        pipe = self._r.pipeline()
        pipe.zadd(HOSTS, {host: now})
        pipe.hset(host_nodes_key(host), node, f"{kind} {now}")
        pipe.hset(host_info_key(host), mapping={k: str(v) for k, v in capacity.items()})
        pipe.execute()

    def host_node_stopped(self, host: str, node: str, kind: str) -> None:
        """A worker process stopped cleanly: its kind is down at once; the host leaves the hosts
        list with its last process."""
        key = host_nodes_key(host)
        self._r.hset(key, node, f"{kind} 0")
        if not any(float(value.split()[1]) > 0 for value in self._r.hvals(key)):
            self._r.zrem(HOSTS, host)

    def host_nodes(self, host: str) -> dict[str, tuple[str, float]]:
        """node -> (queue kind, last beat; 0 once it stopped)."""
        out = {}
        for node, value in self._r.hgetall(host_nodes_key(host)).items():
            kind, _, at = value.partition(" ")
            out[node] = (kind, float(at or 0))
        return out

    def known_hosts(self) -> dict[str, float]:
        """Every host in the hosts list, with its last heartbeat."""
        return dict(self._r.zrange(HOSTS, 0, -1, withscores=True))

    def forget_host(self, host: str) -> None:
        pipe = self._r.pipeline()
        pipe.zrem(HOSTS, host)
        pipe.delete(host_nodes_key(host), host_info_key(host))
        pipe.execute()

    # ---- placement --------------------------------------------------------------------------
    def place(self, task_key: str, request_id: str, affinity: str, rule: Placement) -> Allocation:
        """Allocate a run on the best host (see _PLACE); CapacityError when none has room
        (code WORKERS_DOWN when no host is serving)."""
        req_key = request_key(task_key, request_id) if request_id else ""
        now = str(time.time())
        args = [PREFIX, task_key, new_run_id(), now, req_key, request_id, rule.cutoff, affinity]
        args += [rule.default_tasks, rule.default_runs, rule.slack, rule.kinds, rule.fallback, IDEMPOTENCY_TTL]
        reply = self._place(args=args + [RECENT_RUNS_KEPT, RECORD_TTL])
        if reply[0] == "full":
            raise CapacityError(reply[1])
        return Allocation(run_id=reply[1], host=reply[2], reused=reply[0] == "reused")

    def redis_uptime(self, max_age: float = 0.0) -> float:
        """Seconds since Redis (re)started: no heartbeat could arrive before. With max_age, a
        start time read at most that many seconds ago answers (one INFO per period, not per call)."""
        now = time.monotonic()
        seen = self._redis_started
        if seen is None or now - seen[0] > max_age:
            seen = self._redis_started = (now, now - float(self._r.info("server")["uptime_in_seconds"]))
        return now - seen[1]

    def host_info(self, host: str) -> dict:
        return self._r.hgetall(host_info_key(host))

    def host_load(self, host: str) -> dict:
        """Live runs and images cached on the host (for /status and `hosts list`)."""
        pipe = self._r.pipeline()
        pipe.zcard(host_live_key(host))
        pipe.scard(images_key(host))
        pipe.scard(host_lost_key(host))
        live, images, lost = pipe.execute()
        return {"live_runs": live, "images_cached": images, "lost_runs": lost}

    # ---- drain ------------------------------------------------------------------------------
    def set_draining(self, host: str, draining: bool) -> None:
        if draining:
            self._r.sadd(DRAINING, host)
        else:
            self._r.srem(DRAINING, host)

    def draining_hosts(self) -> set[str]:
        return self._r.smembers(DRAINING)

    # ---- loss -------------------------------------------------------------------------------
    def mark_host_lost(self, host: str, error: str) -> list[str]:
        """Mark the host's live runs lost and free its capacity; returns those runs."""
        runs = self._mark_lost(args=[PREFIX, host, time.time(), failures.cap(error)])
        for run_id in runs:
            for job_id in self.run_jobs(run_id):
                self.fail_lost_job(job_id, error, code="HOST_LOST")
        return runs

    def lost_runs(self, host: str) -> list[str]:
        return list(self._r.smembers(host_lost_key(host)))

    def settle_lost_runs(self, host: str) -> list[str]:
        """The host is back: its lost runs are closed, so its reconcile removes their containers."""
        runs = self.lost_runs(host)
        for run_id in runs:
            if self.transition(run_id, (LOST_STATE,), "closed"):
                self.mark_closed(run_id)
            self._r.srem(host_lost_key(host), run_id)
        return runs

    # ---- Celery's queues (kombu's lists in the same Redis) ---------------------------------
    def queue_depths(self, queues: list[str]) -> dict[str, int]:
        """Messages waiting in each queue (module docstring: one list per queue), one round trip."""
        pipe = self._r.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        return dict(zip(queues, pipe.execute()))


# ---- many hosts: the placement and host-lost scripts (Store's many-hosts methods use them) -------
HOST_FORGET_SECONDS = 3600  # a host silent this long is dropped from the hosts list and /status
LOST_STATE = "lost"

# Placement: every argument is in ARGV (ARGV[1] is the key prefix). A host is a candidate when
# it beat since `cutoff` with every queue kind and is not draining; with no host beating at all
# (a fresh Redis) the facade's own host id is the one candidate, as before. Among candidates
# with room for the task key: the least loaded (live runs over its published capacity), unless
# one within `slack` of that load already holds the task's images (images:<h>), then that one.
_PLACE = """
local p, task_key, run_id, now, req_key, request_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local cutoff, affinity, def_tasks, def_runs = tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
local slack, nkinds, fallback = tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13]
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
local function serving(h)
  if redis.call('SISMEMBER', p .. 'hosts:draining', h) == 1 then return false end
  local nodes = redis.call('HVALS', p .. 'host:' .. h .. ':nodes')
  local kinds, n = {}, 0
  for _, value in ipairs(nodes) do
    local kind, at = string.match(value, '^(%S+) (%S+)$')
    if kind and tonumber(at) >= cutoff and not kinds[kind] then kinds[kind] = true n = n + 1 end
  end
  return n >= nkinds
end
local beating = redis.call('ZRANGEBYSCORE', p .. 'hosts', cutoff, '+inf')
local candidates = {}
for _, h in ipairs(beating) do if serving(h) then table.insert(candidates, h) end end
if #beating == 0 and fallback ~= '' then candidates = {fallback} end
if #candidates == 0 then return {'full', 'WORKERS_DOWN'} end
local fits, code = {}, 'TASK_SLOTS_EXHAUSTED'
for _, h in ipairs(candidates) do
  local info = redis.call('HMGET', p .. 'host:' .. h .. ':info', 'max_tasks', 'max_runs_per_task')
  local max_tasks, max_runs = tonumber(info[1]) or def_tasks, tonumber(info[2]) or def_runs
  local keys_key = p .. 'host:' .. h .. ':keys'
  local n = tonumber(redis.call('HGET', keys_key, task_key) or '0')
  local room
  if n > 0 then
    room = n < max_runs
    if not room then code = 'RUN_SLOTS_EXHAUSTED' end
  else
    room = redis.call('HLEN', keys_key) < max_tasks
  end
  if room then
    local load = redis.call('ZCARD', p .. 'host:' .. h .. ':live') / math.max(max_tasks * max_runs, 1)
    table.insert(fits, {h, load, redis.call('SISMEMBER', p .. 'images:' .. h, affinity) == 1})
  end
end
if #fits == 0 then return {'full', code} end
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
  'state', 'allocated', 'created_at', now, 'last_used_at', now, 'request_id', request_id)
if req_key ~= '' then redis.call('SET', req_key, run_id, 'EX', tonumber(ARGV[14])) end
-- the run viewer's index: the newest runs, expiring with the last record
local recent = p .. 'runs:recent'
redis.call('ZADD', recent, now, run_id)
redis.call('ZREMRANGEBYRANK', recent, 0, -tonumber(ARGV[15]) - 1)
redis.call('EXPIRE', recent, tonumber(ARGV[16]))
return {'new', run_id, host}
"""

# A host is lost: each live run becomes "lost" (HOST_LOST) and leaves the host's capacity count.
_MARK_LOST = """
local p, h, now, err = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local live = redis.call('ZRANGE', p .. 'host:' .. h .. ':live', 0, -1)
for _, run in ipairs(live) do
  redis.call('HSET', p .. 'run:' .. run, 'state', 'lost', 'code', 'HOST_LOST', 'error', err,
    'retryable', 'true', 'lost_at', now)
  redis.call('SADD', p .. 'host:' .. h .. ':lost', run)
end
redis.call('DEL', p .. 'host:' .. h .. ':live', p .. 'host:' .. h .. ':keys')
return live
"""


@dataclass
class Placement:
    """How allocate weighs hosts (Store.place)."""

    cutoff: float  # a host's workers must have beaten since then
    kinds: int  # ... with this many queue kinds
    default_tasks: int  # capacity of a host that has not published its own
    default_runs: int
    slack: float  # load difference image affinity may outweigh
    fallback: str  # the one candidate when no host beats at all


# ---- locks ----------------------------------------------------------------------------------
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
# KEYS: tasks set, pool list, starting zset, demand zset. ARGV: task path, now, window start.
_WARM_FORGET_TASK = """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
if redis.call('LLEN', KEYS[2]) + redis.call('ZCARD', KEYS[3]) + redis.call('EXISTS', KEYS[4]) > 0 then
  return 0
end
return redis.call('SREM', KEYS[1], ARGV[1])
"""

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
