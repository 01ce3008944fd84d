"""Runs and their leases: run:<id>, run:<id>:jobs, the host's capacity and liveness sets a run
moves through (host:<h>:keys, :live, :closing) and the run viewer's index (runs:recent)."""

from __future__ import annotations

import secrets
import time

import redis

from poolcore import failures
from poolcore.state import keys
from poolcore.state.codec import decode, encode

STARTED_STATES = ("ready", "busy", "evaluating", "evaluated")  # a run whose environment is started
CALLABLE_STATES = ("ready", "evaluated")  # stored states a tool call in flight shows as busy
NO_FAILURE = {"error": "", "code": "", "retryable": None}  # update_run(**NO_FAILURE): forget a failure


class UnknownRun(KeyError):
    pass


# The scripts build run:<id> and host:<h>:{keys,live,closing} from the prefix they are given.
# ARGV: prefix, run, reason, now, the only state to release from ('' for any), and, for the
# idle reaper, the idle cutoff ('' for none): then the run is released only if it was last used
# before it and none of its jobs is working: running, or queued since the cutoff (a job queued
# longer, never taken, holds nothing: its message may be gone). Jobs that ended without leaving
# the working set (expired records) are dropped from it. One script: a call starting between
# the reaper's look and its release cannot be closed under. Then, optionally, a job to record
# under the run once released (its teardown, as create_job would: id, then field, value pairs).
RELEASE_LUA = """
local prefix, run_id = ARGV[1], ARGV[2]
local run_key = prefix .. 'run:' .. run_id
local state = redis.call('HGET', run_key, 'state')
if not state or state == 'closing' or state == 'closed' then return false end
if ARGV[5] ~= '' and state ~= ARGV[5] then return false end
if ARGV[6] ~= '' then
  local cutoff = tonumber(ARGV[6])
  if tonumber(redis.call('HGET', run_key, 'last_used_at') or '0') > cutoff then return false end
  local working = run_key .. ':working'
  local jobs = redis.call('SMEMBERS', working)
  local fork_job = redis.call('HGET', run_key, 'fork_job')  -- a fork's child: made by its source's job
  if fork_job then table.insert(jobs, fork_job) end
  for _, job_id in ipairs(jobs) do
    local job = redis.call('HMGET', prefix .. 'job:' .. job_id, 'state', 'queued_at')
    if job[1] == 'running' or (job[1] == 'queued' and tonumber(job[2] or '0') > cutoff) then return false end
    if job[1] ~= 'queued' then redis.call('SREM', working, job_id) end
  end
end
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
local tenant = redis.call('HGET', run_key, 'tenant')  -- its slot is free: its tenant's count too
if tenant then redis.call('SREM', prefix .. 'tenant:' .. tenant .. ':live', run_id) end
if ARGV[7] and ARGV[7] ~= '' then  -- the teardown's job, recorded with the release
  redis.call('HSET', prefix .. 'job:' .. ARGV[7], unpack(ARGV, 8))
  redis.call('RPUSH', run_key .. ':jobs', ARGV[7])
  redis.call('SADD', run_key .. ':working', ARGV[7])
  return {host, redis.call('HGET', run_key, 'priority') or ''}  -- the teardown goes at the run's class
end
return host
"""


# One run of a host is lost (its containers died with a previous incarnation of its host, or
# under a restarted Docker engine): it leaves the host's capacity and becomes "lost" (with the
# code given) while still in one of the states given, as _MARK_LOST (hosts.py) does for a whole
# host. ARGV: prefix, run, now, error, code, states.
MARK_RUN_LOST_LUA = """
local prefix, run_id = ARGV[1], ARGV[2]
local run_key = prefix .. 'run:' .. run_id
local state = redis.call('HGET', run_key, 'state')
local allowed = false
for i = 6, #ARGV do if state == ARGV[i] then allowed = true end end
if not allowed then return 0 end
local host, task_key = redis.call('HGET', run_key, 'host'), redis.call('HGET', run_key, 'task_key')
local keys_key = prefix .. 'host:' .. host .. ':keys'
if redis.call('HINCRBY', keys_key, task_key, -1) <= 0 then redis.call('HDEL', keys_key, task_key) end
redis.call('ZREM', prefix .. 'host:' .. host .. ':live', run_id)
redis.call('SADD', prefix .. 'host:' .. host .. ':lost', run_id)
redis.call('HSET', run_key, 'state', 'lost', 'code', ARGV[5], 'error', ARGV[4], 'retryable', 'true', 'lost_at', ARGV[3])
local tenant = redis.call('HGET', run_key, 'tenant')
if tenant then redis.call('SREM', prefix .. 'tenant:' .. tenant .. ':live', run_id) end
return 1
"""


# A live run's record, marked as used (last_used_at), and, for a tool call, with the call's job
# as the run's call_job (a run whose call_job has not ended shows as busy: Store.shown_run) and
# the job's record written and listed under the run (KEYS[2], KEYS[3]; after ARGV[3]'s count
# of field names to return, ARGV[4..]: the record's fields) in the same round trip, and the
# job joins the run's working set (KEYS[4]), which it leaves when it ends (jobs.py FINISH_JOB_LUA). The record
# is returned as it was: one read and one write, on every operation's hot path. The host's live zset keeps the score of the run's allocation: the
# reaper reads last_used_at itself before it calls a run idle (idle_runs), so no call pays a
# ZADD for it.
USE_RUN_LUA = """
local run_key, now, call_job, n = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local record, state = {}, nil
if n > 0 then  -- only these fields: a tool call needs a few, not the run's tool schemas and prompt
  local names = {unpack(ARGV, 4, 3 + n)}
  local values = redis.call('HMGET', run_key, unpack(names))
  for i = 1, n do
    if values[i] then table.insert(record, names[i]) table.insert(record, values[i]) end
    if names[i] == 'state' then state = values[i] end
  end
else
  record = redis.call('HGETALL', run_key)
  for i = 1, #record, 2 do if record[i] == 'state' then state = record[i + 1] end end
end
if not state or state == 'closing' or state == 'closed' then return false end
if call_job ~= '' then
  redis.call('HSET', run_key, 'last_used_at', now, 'call_job', call_job)
  redis.call('SADD', KEYS[4], call_job)
  if #ARGV > 3 + n and redis.call('EXISTS', KEYS[2]) == 0 then  -- recorded once, if sent again
    redis.call('HSET', KEYS[2], unpack(ARGV, 4 + n))
    redis.call('RPUSH', KEYS[3], call_job)
  end
else
  redis.call('HSET', run_key, 'last_used_at', now)
end
return record
"""

SET_IF_LIVE_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'closing' or state == 'closed' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# Set fields of a run only while it is in one of the states given. ARGV: n, n states, fields.
IF_STATE_LUA = """
local state, n = redis.call('HGET', KEYS[1], 'state'), tonumber(ARGV[1])
for i = 2, n + 1 do
  if state == ARGV[i] then redis.call('HSET', KEYS[1], unpack(ARGV, n + 2)) return 1 end
end
return 0
"""

TRANSITION_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
for i = 2, #ARGV do
  if state == ARGV[i] then redis.call('HSET', KEYS[1], 'state', ARGV[1]) return 1 end
end
return 0
"""


def new_run_id() -> str:
    return "run-" + secrets.token_hex(8)


class RunsState:
    """Store's runs: allocation itself is placement (HostsState.place)."""

    _r: redis.Redis  # Store.__init__ sets it
    record_ttl: int  # and this (RECORD_TTL)

    def get_run(self, run_id: str) -> dict | None:
        raw = self._r.hgetall(keys.run_key(run_id)) if run_id else {}
        return decode(raw) if raw else None

    def run_owner(self, run_id: str) -> str | None:
        """The tenant whose run it is ("" for the operator's), None for no such run."""
        state, tenant = self._r.hmget(keys.run_key(run_id), "state", "tenant") if run_id else (None, None)
        return None if state is None else tenant or ""

    def run_priority(self, run_id: str) -> str | None:
        """The run's priority class (poolcore/priorities.py); None for a record without one."""
        return self._r.hget(keys.run_key(run_id), "priority") if run_id else None

    def run_state(self, run_id: str) -> str | None:
        """A run's state alone (None for no such run): what a sweep over every resource asks."""
        return self._r.hget(keys.run_key(run_id), "state") if run_id else None

    def runs_fields(self, run_ids: list[str], fields: tuple) -> dict[str, dict]:
        """These fields of each run's record (those it has, decoded as get_run decodes them),
        by run id, in one round trip: a sweep over every live run of a host reads no more."""
        pipe = self._r.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hmget(keys.run_key(run_id), *fields)
        return {
            run_id: decode({field: value for field, value in zip(fields, values) if value is not None})
            for run_id, values in zip(run_ids, pipe.execute())
        }

    def shown_run(self, run_id: str) -> dict | None:
        """A run's record as users see it (the runs API, the viewer): a ready (or evaluated)
        run whose latest tool call (call_job) is queued or running reads as busy. Derived when
        read, so a call's end writes nothing to its run, and the sweeps that read every live
        run (get_run) pay nothing for it."""
        run = self.get_run(run_id)
        call_job = (run or {}).get("call_job")
        calling = run and run["state"] in CALLABLE_STATES and call_job
        if calling and self._r.hget(keys.job_key(call_job), "state") in ("queued", "running"):
            run["state"] = "busy"
        return run

    def require_run(self, run_id: str) -> dict:
        run = self.get_run(run_id)
        if run is None:
            raise UnknownRun(run_id)
        return run

    def update_run(self, run_id: str, **fields) -> None:
        if fields:
            self._r.hset(keys.run_key(run_id), mapping=encode(fields))

    def touch(self, run_id: str) -> bool:
        """Record use of a live run; False when the lease is unknown or released."""
        return self.use_run(run_id, fields=("state",)) is not None

    def use_run(self, run_id: str, call_job: str = "", job: dict | None = None, fields: tuple = ()) -> dict | None:
        """A live run's record (only `fields` of it, with `state`, when given), marked as used
        (touch) in the same round trip; None when the lease is unknown or released. With
        call_job (a tool call's job), the run reads as busy until that job ends, and `job`
        (the fields of its record: JobsState.job_fields) is recorded and listed under the run,
        only if the run is live. The record is returned as it was."""
        if not run_id:
            return None
        names = list(dict.fromkeys(("state", *fields))) if fields else []
        pairs = [item for pair in encode(job).items() for item in pair] if job and call_job else []
        raw = self._use_run(
            keys=[
                keys.run_key(run_id),
                keys.job_key(call_job),
                keys.run_jobs_key(run_id),
                keys.run_working_key(run_id),
            ],
            args=[time.time(), call_job, len(names), *names, *pairs],
        )
        return decode(dict(zip(raw[::2], raw[1::2]))) if raw else None

    def claim_request(self, run_id: str, key: str, job_id: str) -> str:
        """The job that a request with this idempotency key queues on the run: job_id when the
        key is new (now held for IDEMPOTENCY_TTL), else the job of the first such request. One
        SET NX GET: sent again by Redis's client, it finds job_id, its own."""
        held = self._r.set(keys.run_request_key(run_id, key), job_id, nx=True, get=True, ex=keys.IDEMPOTENCY_TTL)
        return held or job_id

    def drop_request(self, run_id: str, key: str, job_id: str) -> None:
        """Let the key go when its request was refused (nothing was queued): held by job_id only."""
        key_name = keys.run_request_key(run_id, key)
        if self._r.get(key_name) == job_id:
            self._r.delete(key_name)

    def set_state_if_live(self, run_id: str, state: str, **fields) -> bool:
        """Change a run's state unless it has been released meanwhile (close wins): one
        atomic round trip, so a close landing between the check and the write cannot be undone."""
        flat = [item for pair in encode({"state": state, **fields}).items() for item in pair]
        return bool(self._set_if_live(keys=[keys.run_key(run_id)], args=flat))

    def transition(self, run_id: str, from_states: tuple, to_state: str) -> bool:
        """Atomically move a run to to_state only if it is in one of from_states."""
        return bool(self._transition(keys=[keys.run_key(run_id)], args=[to_state, *from_states]))

    def release(self, run_id: str, reason: str = "closed", only_state: str = "") -> bool:
        """Free the run's capacity slot and mark it closing; False if already released (or,
        with only_state, when the run is no longer in that state)."""
        return self.release_on_host(run_id, reason, only_state) is not None

    def release_if_idle(self, run_id: str, idle_ttl: float) -> bool:
        """Release a run (reason "idle") only if it is idle at this moment: last used (a call
        begun, or its last job ended) idle_ttl seconds ago or more, and no job of it (nor the
        fork making it) working. One atomic check and release."""
        args = [keys.PREFIX, run_id, "idle", time.time(), "", time.time() - idle_ttl]
        return self._release(args=args) is not None

    def release_on_host(self, run_id: str, reason: str = "closed", only_state: str = "") -> str | None:
        """release() in one round trip, returning the run's host (None when nothing was
        released). A lost run, already out of its host's capacity, becomes closing too: its
        teardown waits in its host's queue."""
        return self._release(args=[keys.PREFIX, run_id, reason, time.time(), only_state, ""]) or None

    def release_for_close(self, run_id: str, job: dict) -> tuple[str | None, str | None]:
        """release_on_host that records `job` (the teardown's record: job_fields) under the run
        in the same round trip, only if it was released: (its host, its priority class), or
        (None, None) when nothing was released."""
        pairs = [item for pair in encode(job).items() for item in pair]
        args = [keys.PREFIX, run_id, "closed", time.time(), "", "", job["job_id"], *pairs]
        released = self._release(args=args)
        return (released[0], released[1] or None) if released else (None, None)

    def mark_run_lost(self, run_id: str, error: str, states: tuple, code: str = "HOST_LOST") -> bool:
        """The run died with its host's previous incarnation (HOST_LOST), or its container under
        a restarted Docker engine (CONTAINER_LOST): lost, with that code, if still in one of
        `states`; its host's next reconcile closes it (settle_lost_runs)."""
        args = [keys.PREFIX, run_id, time.time(), failures.cap(error), code, *states]
        return bool(self._mark_run_lost(args=args))

    def end_run(self, run_id: str, code: str, error: str) -> str | None:
        """End a started run for a failure of its own (RUN_DISK_LIMIT): it keeps the code and
        error, is released with the code as its closing reason (calls on it answer that code,
        app/engine.py) and its running and queued jobs fail with it. Returns its host (None when
        it was not started or already released); the caller queues its teardown."""
        fields = {"error": failures.cap(error), **failures.fields(code)}
        flat = [item for pair in encode(fields).items() for item in pair]
        if not self._if_state(keys=[keys.run_key(run_id)], args=[len(STARTED_STATES), *STARTED_STATES, *flat]):
            return None
        host = self.release_on_host(run_id, reason=code)
        if host is not None:
            for job_id in self.run_jobs(run_id):
                self.fail_lost_job(job_id, fields["error"], code=code)
        return host

    def mark_closed(self, run_id: str, error: str = "") -> None:
        host = self._r.hget(keys.run_key(run_id), "host")
        pipe = self._r.pipeline()
        pipe.hset(keys.run_key(run_id), mapping=encode({"state": "closed", "closed_at": time.time()}))
        if error:
            pipe.hset(keys.run_key(run_id), "teardown_error", error)
        if host:
            pipe.srem(keys.host_closing_key(host), run_id)
        pipe.expire(keys.run_key(run_id), self.record_ttl)
        pipe.expire(keys.run_jobs_key(run_id), self.record_ttl)
        pipe.delete(keys.run_working_key(run_id))
        pipe.execute()
        self.drop_sessions(run_id)

    def idle_runs(self, host: str, idle_ttl: float) -> list[str]:
        """Live runs of `host` unused for idle_ttl seconds. The live zset's scores lag (use_run
        does not move them), so each candidate's own last_used_at decides, and a run used
        since gets its score moved up to it (read only by this sweep)."""
        cutoff = time.time() - idle_ttl
        candidates = self._r.zrangebyscore(keys.host_live_key(host), "-inf", cutoff)
        if not candidates:
            return []
        pipe = self._r.pipeline(transaction=False)
        for run_id in candidates:
            pipe.hget(keys.run_key(run_id), "last_used_at")
        idle, used = [], {}
        for run_id, at in zip(candidates, pipe.execute()):
            if at is not None and float(at) > cutoff:
                used[run_id] = float(at)
            else:
                idle.append(run_id)
        if used:
            self._r.zadd(keys.host_live_key(host), used, xx=True)
        return idle

    def never_reset_runs(self, host: str, older_than: float) -> list[str]:
        """Runs allocated more than older_than seconds ago that were never reset or started."""
        runs = self.live_runs(host)
        if not runs:
            return []
        pipe = self._r.pipeline()
        for run_id in runs:
            pipe.hmget(keys.run_key(run_id), "state", "created_at", "start_job")
        cutoff = time.time() - older_than
        return [
            run_id
            for run_id, (state, created, start_job) in zip(runs, pipe.execute())
            if state == "allocated" and not start_job and created is not None and float(created) < cutoff
        ]

    def live_runs(self, host: str) -> list[str]:
        return self._r.zrange(keys.host_live_key(host), 0, -1)

    def tenant_live_runs(self, tenant: str) -> list[str]:
        """The tenant's runs holding a slot (placement's count of it: docs/tenants.md)."""
        return sorted(self._r.smembers(keys.tenant_live_key(tenant)))

    def tenant_live_counts(self, tenants: list[str]) -> dict[str, int]:
        """Each tenant's runs holding a slot, counted in one round trip (the pool dashboard)."""
        pipe = self._r.pipeline(transaction=False)
        for tenant in tenants:
            pipe.scard(keys.tenant_live_key(tenant))
        return dict(zip(tenants, pipe.execute()))

    def closing_runs(self, host: str) -> list[str]:
        return list(self._r.smembers(keys.host_closing_key(host)))

    def stale_closing_runs(self, host: str, older_than: float) -> list[str]:
        """Runs released more than older_than seconds ago whose teardown has not ended."""
        runs = self.closing_runs(host)
        if not runs:
            return []
        pipe = self._r.pipeline()
        for run_id in runs:
            pipe.hget(keys.run_key(run_id), "last_used_at")
        cutoff = time.time() - older_than
        return [run_id for run_id, at in zip(runs, pipe.execute()) if at is None or float(at) < cutoff]

    def unended_closes(self, run_ids: list[str]) -> dict[str, list[dict]]:
        """Each run's close jobs not yet ended ({"state", "queued_at"}), read from its working
        set (a job leaves it when it ends): two round trips for any number of runs."""
        pipe = self._r.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.smembers(keys.run_working_key(run_id))
        working = dict(zip(run_ids, pipe.execute()))
        for job_ids in working.values():
            for job_id in job_ids:
                pipe.hmget(keys.job_key(job_id), "kind", "state", "queued_at")
        records = iter(pipe.execute())
        closes: dict[str, list[dict]] = {run_id: [] for run_id in run_ids}
        for run_id, job_ids in working.items():
            for kind, state, queued_at in (next(records) for _ in job_ids):
                if kind == "close" and state in ("queued", "running"):
                    closes[run_id].append({"state": state, "queued_at": float(queued_at or 0)})
        return closes

    def host_status(self, host: str) -> dict:
        task_runs = self._r.hgetall(keys.host_tasks_key(host))  # not `keys`: that names the keys module
        return {
            "active_tasks": len(task_runs),
            "total_active_runs": sum(int(v) for v in task_runs.values()),
            "pending_closes": self._r.scard(keys.host_closing_key(host)),
            "tasks": {key: {"active_runs": int(n)} for key, n in sorted(task_runs.items())},
        }

    # ---- recent runs (the run viewer) ------------------------------------------------------
    def recent_runs(self, fields: tuple, count: int, before: float | None = None) -> tuple[list[dict], float | None]:
        """Up to `count` indexed runs created before `before` (all when None), newest first,
        with the given fields of their records; and where to continue (None at the end).
        Ids whose record has expired are dropped from the index."""
        upper = "+inf" if before is None else f"({before!r}"
        page = self._r.zrevrangebyscore(keys.RECENT_RUNS, upper, "-inf", start=0, num=count, withscores=True)
        pipe = self._r.pipeline()
        for run_id, _ in page:
            pipe.hmget(keys.run_key(run_id), "state", *fields)
        runs, gone = [], []
        for (run_id, _), values in zip(page, pipe.execute()):
            if values[0] is None:
                gone.append(run_id)
                continue
            found = {field: value for field, value in zip(("state", *fields), values) if value is not None}
            runs.append(decode({**found, "run_id": run_id}))
        if gone:
            self._r.zrem(keys.RECENT_RUNS, *gone)
        return runs, (page[-1][1] if len(page) == count else None)

    def first_jobs(self, run_ids: list[str], fields: tuple) -> dict[str, dict]:
        """The first job of each run (its start job, if it was ever started), by run id."""
        pipe = self._r.pipeline()
        for run_id in run_ids:
            pipe.lindex(keys.run_jobs_key(run_id), 0)
        job_ids = dict(zip(run_ids, pipe.execute()))
        pipe = self._r.pipeline()
        for job_id in filter(None, job_ids.values()):
            pipe.hmget(keys.job_key(job_id), "kind", *fields)
        values = iter(pipe.execute())
        jobs = {}
        for run_id, job_id in job_ids.items():
            if job_id:
                record = dict(zip(("kind", *fields), next(values)))
                jobs[run_id] = decode({k: v for k, v in record.items() if v is not None} | {"job_id": job_id})
        return jobs
