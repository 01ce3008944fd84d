"""Jobs: job:<id>, its done list, an episode's chain (episode:<start job>) and the jobs a worker
process is running (worker:<token>:jobs), which tasks/lost_jobs.py recovers when it dies."""

from __future__ import annotations

import functools
import json
import secrets
import time

import redis

from poolcore import failures
from poolcore.state import keys
from poolcore.state.codec import decode, encode
from poolcore.state.recent import NO_TENANT, minute

# A worker process takes a job's message: a queued job starts (its first attempt); unless the
# job is settled already, it is listed under the process (lost_jobs) with its node and, when
# it may be sent again after the process dies, how (retry_with). Each message runs a job at most
# once: its delivery (ARGV[6]: the message's task id and retry count, the same in every copy of
# it) is marked with the taker's nonce (ARGV[7]), and another taker of the same delivery (a copy
# that a publish retry or a redelivery made) gets 'duplicate'. The same taker sending this
# script again (Redis's client resends a command whose reply was lost) goes on: a retry of the
# job (Celery's, or lost_jobs' after its process died) is a new delivery.
BEGIN_JOB_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'succeeded' or state == 'failed' then return state end
local mark = 'taken:' .. ARGV[6]
local taker = redis.call('HGET', KEYS[1], mark)
if taker and taker ~= ARGV[7] then return 'duplicate' end
local fields = {mark, ARGV[7], 'node', ARGV[2], 'worker', ARGV[3]}
if state == 'queued' then
  for _, v in ipairs({'state', 'running', 'started_at', ARGV[1], 'attempts', 1}) do table.insert(fields, v) end
end
if ARGV[4] ~= '' then table.insert(fields, 'retry_with') table.insert(fields, ARGV[4]) end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('SADD', KEYS[2], ARGV[5])
return state
"""

# A job recorded and listed under its run, once: sent again (a resend of a command whose reply
# was lost), it changes nothing. KEYS: job, the run's job list, its working set; ARGV: fields.
_CREATE_JOB = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# One more attempt of a job, counted once per retry: the retry is named (ARGV[1]: its step and
# the retries of the message it sends; a job's steps, an image build then a start, retry each
# on its own), so the same write sent again counts nothing. KEYS: job, the retry counts; ARGV:
# the retry, the count's field, then the job's field, value pairs. Returns the attempt (0: counted).
_JOB_ATTEMPT = """
if redis.call('HSETNX', KEYS[1], 'retry:' .. ARGV[1], 1) == 0 then return 0 end
redis.call('HSETNX', KEYS[1], 'attempts', 1)
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
return attempt
"""

# A job's end, in one script (no pipeline: one command less per call than MULTI/EXEC, and no
# SCRIPT EXISTS check). KEYS: job, its done list, the process's job list (lost_jobs), the failure
# counts. ARGV: the end's state, the record TTL, the job id, the failure code to count ('' for
# none), the key prefix, the time now, then field, value pairs. The end is written unless the
# job ended already: a job the facade failed (its worker silent past the limit, WORKERS_DOWN /
# HOST_LOST) keeps the outcome its caller was given, and a late end from a worker that resumes
# is kept beside it as late_state. The job leaves its run's working set, and a live run counts
# as used now: its idle clock starts when its last job ends (the reaper never closes a run
# under a job: RunsState.release's idle check). A tool call's run needs no other write: it
# reads as busy only while the call's job has not ended (Store.shown_run).
FINISH_JOB_LUA = """
local job, done, worker_jobs, counts, recent = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local end_state, ttl, job_id, code, prefix, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local recent_ttl, no_tenant = ARGV[7], ARGV[8]
local state, run_id = unpack(redis.call('HMGET', job, 'state', 'run_id'))
if state == 'succeeded' or state == 'failed' then
  redis.call('HSET', job, 'late_state', end_state)
else
  redis.call('HSET', job, unpack(ARGV, 9))
  if code ~= '' then
    redis.call('HINCRBY', counts, code, 1)
    -- the last hour's record (recent.py), by the run's tenant
    local tenant = run_id and redis.call('HGET', prefix .. 'run:' .. run_id, 'tenant') or ''
    if not tenant or tenant == '' then tenant = no_tenant end
    redis.call('HINCRBY', recent, tenant .. '|' .. code, 1)
    redis.call('EXPIRE', recent, recent_ttl)
  end
end
if redis.call('LLEN', done) == 0 then redis.call('RPUSH', done, end_state) end  -- a wake-up, once
redis.call('EXPIRE', job, ttl)
redis.call('EXPIRE', done, ttl)
if worker_jobs ~= '' then redis.call('SREM', worker_jobs, job_id) end
if run_id then
  local run_key = prefix .. 'run:' .. run_id
  if redis.call('SREM', run_key .. ':working', job_id) == 1 then
    local run_state = redis.call('HGET', run_key, 'state')
    if run_state and run_state ~= 'closing' and run_state ~= 'closed' then
      redis.call('HSET', run_key, 'last_used_at', now)
    end
  end
end
return 1
"""

# A client cancels a job (a command: app/commands_api.py): an unfinished job gets the cancel
# mark its worker watches for (tasks/command_jobs.py); the job's state before is returned.
CANCEL_JOB_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'queued' or state == 'running' then redis.call('HSET', KEYS[1], 'cancel_requested', ARGV[1]) end
return state
"""


class JobsState:
    """Store's jobs."""

    _r: redis.Redis  # Store.__init__ sets it
    record_ttl: int  # and this (RECORD_TTL)

    @functools.cached_property
    def _create_job(self):
        return self._r.register_script(_CREATE_JOB)

    @functools.cached_property
    def _job_attempt(self):
        return self._r.register_script(_JOB_ATTEMPT)

    @staticmethod
    def job_fields(job_id: str, run_id: str, kind: str, **extra) -> dict:
        """A new (queued) job's record."""
        return {"job_id": job_id, "run_id": run_id, "kind": kind, "state": "queued", "queued_at": time.time(), **extra}

    def create_job(self, job_id: str, run_id: str, kind: str, **extra) -> None:
        """Record a queued job under its run (once: _CREATE_JOB)."""
        pairs = [item for pair in encode(self.job_fields(job_id, run_id, kind, **extra)).items() for item in pair]
        keys_ = [keys.job_key(job_id), keys.run_jobs_key(run_id), keys.run_working_key(run_id)]
        self._create_job(keys=keys_, args=[job_id, *pairs])

    def discard_job(self, job_id: str, run_id: str) -> None:
        """Take back a job recorded with its run's use (use_run) whose call was then refused:
        it was never sent."""
        pipe = self._r.pipeline(transaction=False)
        pipe.delete(keys.job_key(job_id))
        pipe.lrem(keys.run_jobs_key(run_id), 0, job_id)
        pipe.srem(keys.run_working_key(run_id), job_id)
        pipe.execute()

    def begin_job(
        self,
        job_id: str,
        node: str,
        token: str = "",
        retry_with: dict | None = None,
        delivery: str = "",
        taker: str = "",
    ) -> str | None:
        """A job's message (`delivery`: its task id and retry count) is being run by worker
        process `token` on `node` (`taker`: a nonce of this one run of the message): returns
        the job's state before, or "duplicate" when another taker holds this delivery (a copy
        of the message: it must not run). A queued job is now running, its first attempt; a
        retry only moves it to its new node. Unless it was settled already, the job is listed
        under the process (lost_jobs) until job_left or job_finished(..., worker=token). One
        round trip."""
        encoded = json.dumps(retry_with) if retry_with is not None else ""
        taker = taker or secrets.token_hex(8)
        return self._begin_job(
            keys=[keys.job_key(job_id), keys.worker_jobs_key(token)],
            args=[time.time(), node, token, encoded, job_id, delivery or job_id, taker],
        )

    def job_retrying(self, job_id: str, task: str, code: str, error: str, retries: int) -> None:
        """A transient failure of step `task` will be retried by a message with `retries`: the
        job stays running, one attempt more (once, however often this is sent)."""
        fields = {"retry_code": code, "retry_error": failures.cap(error)}
        self._count_attempt(job_id, f"{task}:{retries}", f"{task}|{code}", fields)

    def _count_attempt(self, job_id: str, retry: str, counted: str, fields: dict) -> int:
        pairs = [item for pair in fields.items() for item in pair]
        return self._job_attempt(keys=[keys.job_key(job_id), keys.RETRY_COUNTS], args=[retry, counted, *pairs])

    def job_finished(
        self,
        job_id: str,
        result=None,
        error: str = "",
        code: str = "",
        counted: bool = True,
        worker: str = "",
        **extra,
    ) -> None:
        """End a job. A failure (an error) carries its code and retryable, and is counted by
        code for /metrics unless `counted` is false (a step skipped for another's failure).
        With `worker`, the job also leaves that process's list (job_left), in the same round
        trip."""
        state = "failed" if error else "succeeded"
        fields = {"state": state, "finished_at": time.time(), "result": result, "error": failures.cap(error), **extra}
        if error:
            code = code or "INTERNAL"
            fields.update(failures.fields(code))
        pairs = [item for pair in encode(fields).items() for item in pair]
        self._finish_job(
            keys=[
                keys.job_key(job_id),
                keys.job_done_key(job_id),
                keys.worker_jobs_key(worker) if worker else "",
                keys.FAILURE_COUNTS,
                keys.recent_failures_key(minute()),
            ],
            args=[
                *(state, self.record_ttl, job_id, code if error and counted else "", keys.PREFIX, time.time()),
                *(keys.RECENT_TTL, NO_TENANT, *pairs),
            ],
        )

    def request_cancel(self, job_id: str) -> str | None:
        """Mark an unfinished job as cancelled by its client; its state before (None: no such
        job). Marking twice is harmless."""
        return self._cancel_job(keys=[keys.job_key(job_id)], args=[time.time()])

    def cancel_requested(self, job_id: str) -> bool:
        """Whether the job's client has cancelled it (one HEXISTS: watched by its worker)."""
        return bool(self._r.hexists(keys.job_key(job_id), "cancel_requested"))

    def job_state(self, job_id: str) -> str | None:
        return self._r.hget(keys.job_key(job_id), "state")

    def get_job(self, job_id: str) -> dict | None:
        raw = self._r.hgetall(keys.job_key(job_id)) if job_id else {}
        return decode(raw) if raw else None

    def job_run(self, job_id: str) -> str:
        """The run a job belongs to ("" for no such job): whose it is (app/tenancy.py)."""
        raw = self._r.hget(keys.job_key(job_id), "run_id") if job_id else None
        return decode({"run_id": raw}).get("run_id") or "" if raw is not None else ""

    def get_jobs(self, job_ids: list[str]) -> list[dict]:
        """Several job records in one round trip, in order; expired ones are left out."""
        pipe = self._r.pipeline()
        for job_id in job_ids:
            pipe.hgetall(keys.job_key(job_id))
        return [decode(raw) for raw in pipe.execute() if raw]

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
        return bool(self._r.hsetnx(keys.run_key(run_id), "start_job", job_id))

    def start_job(self, run_id: str) -> str | None:
        return self._r.hget(keys.run_key(run_id), "start_job")

    def set_episode_jobs(self, start_job: str, job_ids: list[str]) -> None:
        """An episode's job ids in chain order, for its error callback."""
        key = keys.episode_key(start_job)
        pipe = self._r.pipeline()  # a transaction: sent again, the list is the same
        pipe.delete(key)
        pipe.rpush(key, *job_ids)
        pipe.expire(key, self.record_ttl)
        pipe.execute()

    def episode_jobs(self, start_job: str) -> list[str]:
        return self._r.lrange(keys.episode_key(start_job), 0, -1)

    def run_jobs(self, run_id: str) -> list[str]:
        return self._r.lrange(keys.run_jobs_key(run_id), 0, -1)

    def wait_job(self, job_id: str, timeout: float | None, poll: float = 5.0) -> dict | None:
        """Block until the job has ended (or timeout seconds pass); return its record.

        BLMOVE of the done list onto itself wakes every waiter without consuming the
        signal; the record is read in the same round trip (Redis runs a connection's
        pipelined commands in order, so the read waits for the wake-up). Between wake-ups
        it checks that the worker running the job is alive, so a killed worker fails the
        job instead of hanging the client forever.
        """
        done_key = keys.job_done_key(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = poll if deadline is None else min(poll, deadline - time.monotonic())
            if left <= 0:
                return self.get_job(job_id)
            pipe = self._r.pipeline(transaction=False)
            pipe.blmove(done_key, done_key, max(left, 0.01), "LEFT", "RIGHT")
            pipe.hgetall(keys.job_key(job_id))
            ended, raw = pipe.execute()
            job = decode(raw) if raw else None
            if ended is not None:
                return job
            if job and job.get("state") == "running" and self._abandoned(job):
                # With its process known, a job is abandoned only when its whole host is silent.
                code = "HOST_LOST" if job.get("worker") else "WORKER_LOST"
                self.fail_lost_job(job_id, f"worker {job['node']} was lost while running this job", code=code)

    def _abandoned(self, job: dict) -> bool:
        """The job's worker process is dead and no worker of its host is left to recover it
        (tasks/lost_jobs.py retries what it can): the fallback for a host that is gone."""
        token, node = job.get("worker"), job.get("node") or ""
        if not token:  # recorded before the step's process was known
            return bool(node) and not self.node_alive(node)
        if self.worker_alive(token) or self.host_watched(node.rpartition("@")[2]):
            return False
        return self.take_lost_job(token, job["job_id"])

    # ---- the jobs a worker process is running (tasks/lost_jobs.py) -------------------------
    def job_left(self, job_id: str, token: str) -> None:
        """The step has returned (whatever its outcome): its process no longer holds the job."""
        self._r.srem(keys.worker_jobs_key(token), job_id)

    def worker_jobs(self, token: str) -> list[str]:
        return list(self._r.smembers(keys.worker_jobs_key(token)))

    def running_kinds(self) -> list[str]:
        """The kinds of the jobs worker processes hold now (their lists above), with repeats."""
        job_ids: set[str] = set()
        for key in self._r.scan_iter(match=keys.worker_jobs_key("*"), count=200):
            job_ids.update(self._r.smembers(key))
        return [job.get("kind", "") for job in self.get_jobs(sorted(job_ids)) if job]

    def take_lost_job(self, token: str, job_id: str) -> bool:
        """True for exactly one caller: whoever removes the job from its dead process's set."""
        return bool(self._r.srem(keys.worker_jobs_key(token), job_id))

    def job_lost_retry(self, job_id: str, task: str, error: str, retries: int) -> int:
        """A lost step is sent again by a message with `retries`: one attempt more, counted for
        /metrics as a retry of `task` for WORKER_LOST, once however often this is sent; returns
        the attempt (0 when it was counted already)."""
        fields = {"retry_code": "WORKER_LOST", "retry_error": error}
        return self._count_attempt(job_id, f"lost:{task}:{retries}", f"{task}|WORKER_LOST", fields)

    def fail_lost_job(self, job_id: str, error: str, code: str = "WORKER_LOST") -> bool:
        """End a job whose process died, unless it ended meanwhile; True when this call ended it."""
        if self.job_state(job_id) not in ("queued", "running"):
            return False
        self.job_finished(job_id, error=error, code=code)
        return True
