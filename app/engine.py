"""What both HTTP faces do with a validated request: record it in Redis, enqueue, wait.

No Docker here: the facade only talks to the state store and the Celery broker.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from celery import Celery

from app.refusal_texts import tenant_quota_message
from poolcore import dispatch, hosts, liveness, priorities, task_spec, uploaded_tasks
from poolcore.config import Settings
from poolcore.paths import resolve_task_path
from poolcore.state import (
    LOST_STATE,
    NO_FAILURE,
    STARTED_STATES,
    Allocation,
    CapacityError,
    ForkRefused,
    RecordLost,
    Store,
    new_run_id,
)
from poolcore.tenants import Tenant

WAIT_MARGIN = 60.0  # on top of an operation's own limit, for queueing and bookkeeping
HOST_CHECK_SECONDS = 2.0  # a waiting call looks at its host's heartbeats this often
REASONS_TTL = 2.0  # how long one_per_host keeps an answer (seconds)
REASONS_MAX = 4096  # answers kept before they are all dropped


class UnknownLease(LookupError):
    def __init__(self, run_id: str):
        super().__init__(f"Unknown run_lease_id: {run_id}")


class Refused(RuntimeError):
    """A call refused with a failure code of its own (both faces answer it by its code): the
    subclasses below, and a fork refused before anything was done (FORK_TOO_DEEP, no room on
    the run's host)."""

    def __init__(self, code: str, error: str):
        super().__init__(error)
        self.code = code


class HostUnavailable(Refused):
    """The run's worker host is lost (HOST_LOST) or the queue a call needs has no live worker
    (WORKERS_DOWN): answered 503 at once instead of waiting for the call's time limit."""


class RunEnded(Refused):
    """The pool ended the run for a failure of its own (RUN_DISK_LIMIT: Store.end_run); every
    call on it answers that code, not a plain RUN_CLOSED or unknown lease."""


def raise_if_ended(run: dict | None) -> None:
    """RunEnded for a run released with a failure code as its closing reason."""
    if run and run.get("state") in ("closing", "closed") and run.get("closing_reason") in ENDING_CODES:
        raise RunEnded(run["closing_reason"], run.get("error") or f"run {run['run_id']} was ended")


ENDING_CODES = ("RUN_DISK_LIMIT",)  # closing reasons that are failure codes (Store.end_run)


class JobNotCancellable(Refused):
    def __init__(self, error: str):
        super().__init__("JOB_NOT_CANCELLABLE", error)


class NotReady(RuntimeError):
    """The run cannot take this operation in its current state."""


class RunClosed(RuntimeError):
    """The run has been released; it takes no more operations (runs API)."""


# What a tool call reads of its run (not its tool schemas and prompt: kilobytes per call).
TOOL_CALL_FIELDS = ("run_id", "state", "host", "env", "code", "error", "priority")


@dataclass
class Submission:
    """What POST /v1/runs answers: the run, its start job, and whether it was a repeat."""

    run_id: str
    job_id: str | None
    state: str
    reused: bool
    jobs: dict | None = None  # the episode's job ids by step, when this request started it


@dataclass
class Engine:
    cfg: Settings
    store: Store
    celery: Celery
    watch: liveness.Watch = field(init=False)
    follower: threading.Event | None = None  # stops the monitor follower (poolcore/queues.py)
    reasons: dict = field(default_factory=dict, init=False)  # one_per_host's: task -> (until, reasons)

    def __post_init__(self):
        self.watch = hosts.make_watch(self.cfg).start()  # made per gunicorn worker process

    def stop(self) -> None:
        """Stop the background threads (the liveness watch, the monitor follower)."""
        self.watch.stop()
        if self.follower is not None:
            self.follower.set()

    # ---- leases -----------------------------------------------------------------------------
    def allocate(
        self, task_key: str, request_id: str, task_path: str = "", tenant: Tenant | None = None, priority=None
    ) -> Allocation:
        """Place a run on a serving host (poolcore/hosts.py): the least loaded with room,
        preferring one that has the task's images (known by task_path, else the task key). A
        task that allows one live run per host gets a host without one (CapacityError carries
        the reasons when none is left). `tenant` (None: the operator) is held to its limits in
        the same script (docs/tenants.md). `priority`: the run's class (app/tenancy.py run_priority)."""
        task = task_path or task_key
        reasons = self.one_per_host(task)
        rule = hosts.placement(self.cfg, self.watch, runs_per_host=1 if reasons else 0)
        rule = dataclasses.replace(rule, priority=priority or priorities.DEFAULT)
        if self.cfg.tenants:
            limits = {"tenant": tenant.name, "max_runs": tenant.max_runs} if tenant else {}
            rule = dataclasses.replace(rule, reservations=self.cfg.tenants.reservations(), **limits)
        try:
            return self.store.place(task_key, request_id, task, rule)
        except CapacityError as exc:
            exc.one_per_host = reasons
            raise

    def one_per_host(self, task_path: str) -> tuple[str, ...]:
        """Why the task folder DATASET_DIR/<task_path> allows one live run per host (read from
        its compose file, cached: poolcore/task_spec.py); () for most tasks, and when no task
        folder has that name (a pool API task key is only a key; routers use the task name).
        An uploaded task's were read at its upload (its facts blob). Answers are kept for
        REASONS_TTL: resolving the path and stamping the files was a sixth of an allocate's
        time in the facade, and a task folder edited takes effect that much later."""
        now = time.monotonic()
        known = self.reasons.get(task_path)
        if known and known[0] > now:
            return known[1]
        if len(self.reasons) >= REASONS_MAX:
            self.reasons.clear()
        reasons = self.read_one_per_host(task_path)
        self.reasons[task_path] = (now + REASONS_TTL, reasons)
        return reasons

    def read_one_per_host(self, task_path: str) -> tuple[str, ...]:
        try:
            if uploaded_tasks.is_uploaded(task_path):  # a task key may look like one: PathError
                facts = self.store.get_blob(uploaded_tasks.facts_id(task_path))
                return tuple(json.loads(facts)) if facts else ()
            task_dir = resolve_task_path(self.cfg.dataset_dir, task_path)
            if not task_spec.is_task_dir(task_dir):
                return ()
        except (ValueError, OSError):  # PathError, or a name the file system refuses
            return ()
        return task_spec.one_per_host_reasons(task_dir)

    def require_task(self, task_path: str, tenant: str | None = None) -> None:
        """An uploaded task (sha256:<hex>) must be held: its lifetime starts again with each run
        that names it (UPLOADED_TASK_TTL), else Refused UNKNOWN_TASK, before any slot or job.
        A tenant's run (`tenant`: its name) may only name a task that tenant uploaded: another
        tenant's is answered as one never uploaded (docs/tenants.md)."""
        if not uploaded_tasks.is_uploaded(task_path):
            return
        ttl, blob = self.cfg.uploaded_task_ttl, uploaded_tasks.blob_id(task_path)
        self.store.touch_blob(uploaded_tasks.facts_id(task_path), ttl)  # most have none
        if not self.store.touch_blob(blob, ttl) or tenant and not self.store.blob_held_by(blob, tenant, ttl):
            raise Refused(
                "UNKNOWN_TASK",
                f"task_path {task_path} names no uploaded task this pool holds: never uploaded, or expired "
                f"({self.cfg.uploaded_task_ttl:g} s after its last upload or run); upload it again (POST /v1/tasks)",
            )

    def lease(self, run_id: str, call_job: str = "", job: dict | None = None, fields: tuple = ()) -> dict:
        """A live run, marked as used (with call_job: busy until that tool call's job ends, and
        `job` recorded: Store.use_run); UnknownLease for unknown or released leases,
        HostUnavailable for a run whose host is lost."""
        run = self.store.use_run(run_id, call_job, job, fields)
        if run is None:
            raise_if_ended(self.store.get_run(run_id))
            raise UnknownLease(run_id)
        if run["state"] == LOST_STATE:
            raise HostUnavailable(run.get("code") or "HOST_LOST", run.get("error") or f"run {run_id} is lost")
        return run

    def require_serving(self, run: dict, job_kind: str) -> None:
        """HostUnavailable unless the run's host has live workers for this kind of job."""
        kinds = hosts.JOB_QUEUE_KINDS[job_kind]
        code, error = hosts.check(self.store, self.watch, run["host"], kinds)
        if code:
            raise HostUnavailable(code, error)

    def host_overview(self) -> dict[str, dict]:
        return hosts.overview(self.store, self.cfg, self.watch)

    def readiness(self) -> tuple[bool, str]:
        return hosts.readiness(self.watch)

    def status(self) -> dict:
        overview = self.host_overview()
        names = sorted(set(overview) | {self.cfg.host_id})
        per_host = {host: {**self.store.host_status(host), **overview.get(host, {})} for host in names}
        tasks: dict = {}
        for status in per_host.values():
            for key, value in status["tasks"].items():
                tasks.setdefault(key, {"active_runs": 0})["active_runs"] += value["active_runs"]
        return {
            "max_tasks": self.cfg.max_tasks,
            "active_tasks": len(tasks),
            "max_runs_per_task": self.cfg.max_runs_per_task,
            "total_active_runs": sum(s["total_active_runs"] for s in per_host.values()),
            "pending_closes": sum(s["pending_closes"] for s in per_host.values()),
            "tasks": tasks,
            "hosts": per_host,
        }

    # ---- operations: each returns the job id ------------------------------------------------
    def start(self, run: dict, task_meta: dict, run_ctx: dict, task_timeouts: dict) -> str:
        self.require_task(task_meta["task_path"], run.get("tenant"))
        self.require_serving(run, "start")
        self.store.update_run(
            run["run_id"],
            state="starting",
            task_meta=task_meta,
            run_ctx=run_ctx,
            task_timeouts=task_timeouts,
            **NO_FAILURE,
        )
        path = task_meta["task_path"]
        return dispatch.enqueue_start(self.celery, self.store, run["run_id"], run["host"], path, run.get("priority"))

    def tool_call(self, run_id: str, call: dict, runs_api: bool = False, job_id: str = "") -> str:
        """Queue a tool call on a run; its job id (see _queue_call)."""
        record = dispatch.recorded_call(call)
        send = functools.partial(dispatch.send_tool_call, self.celery, tool_call=call)
        return self._queue_call(run_id, "tool_call", record, send, runs_api, job_id)

    def command(self, run_id: str, command: dict, job_id: str = "") -> str:
        """Queue a command (app/commands_api.py) on a run, as a tool call of the runs API."""
        send = functools.partial(dispatch.send_command, self.celery, command=command)
        return self._queue_call(run_id, "command", dispatch.recorded_command(command), send, True, job_id)

    def _queue_call(self, run_id: str, kind: str, record: dict, send, runs_api: bool, job_id: str = "") -> str:
        """The run's use and the job's record are one round trip (Store.use_run), taken back if
        the call is then refused; the worker gets the run's environment with the call (`send`),
        so it reads nothing of the run. `job_id`: the job's id, when the caller chose it."""
        job_id = job_id or dispatch.new_job_id()
        job = self.store.job_fields(job_id, run_id, kind, call=record)
        try:
            if runs_api:
                run = self.live_run(run_id, call_job=job_id, job=job, fields=TOOL_CALL_FIELDS)
            else:
                run = self.lease(run_id, call_job=job_id, job=job, fields=TOOL_CALL_FIELDS)
            self._require_started(run)
            self.require_serving(run, kind)
            send(run_id=run_id, host=run["host"], job_id=job_id, env=run.get("env"), priority=run.get("priority"))
        except BaseException:
            self.store.discard_job(job_id, run_id)
            raise
        return job_id

    def cancel(self, job_id: str) -> tuple[str | None, dict | None]:
        """Cancel a command job that has not ended: (its state before, its record). A queued
        one ends here (its worker then skips it); a running one is ended by its worker, which
        watches for the mark (tasks/command_jobs.py). (None, None) for an unknown job; other
        kinds are refused (JobNotCancellable) and ended jobs are left as they are."""
        job = self.store.get_job(job_id)
        if job is None:
            return None, None
        if job.get("kind") != "command":
            raise JobNotCancellable(f"job {job_id} is a {job.get('kind')} job; only command jobs can be cancelled")
        state = self.store.request_cancel(job_id)
        if state == "queued":
            self.store.job_finished(job_id, error="cancelled by its client before it started", code="JOB_CANCELLED")
        return state, job

    def evaluation(self, run: dict, job_id: str = "") -> str:
        self._require_started(run)
        self.require_serving(run, "evaluation")
        return dispatch.enqueue_evaluation(
            self.celery, self.store, run["run_id"], run["host"], job_id, run.get("priority")
        )

    def close(self, run_id: str) -> str | None:
        """Release the lease now; the teardown runs after. None when nothing was live."""
        return dispatch.release_and_close(self.celery, self.store, run_id)

    @staticmethod
    def _require_started(run: dict) -> None:
        if run["state"] == "allocated" or not run.get("env") and run["state"] != "starting":
            raise NotReady(f"run {run['run_id']} has not been reset")

    def fork(self, run_id: str, count: int, job_id: str = "") -> tuple[str, list[str]]:
        """K children of a started run on its host, made by one fork job: (job id, child ids).
        The slots are reserved in one script (Store.place_fork) or not at all: CapacityError
        when the host has fewer than `count` free, ForkRefused (FORK_TOO_DEEP) past the depth."""
        run = self.live_run(run_id)
        self.require_serving(run, "fork")
        reasons = self.one_per_host(run["task_meta"]["task_path"])
        children = [new_run_id() for _ in range(count)]
        job_id = job_id or dispatch.new_job_id()
        try:
            host = self.store.place_fork(
                run_id,
                children,
                job_id,
                self.cfg.fork_max_depth,
                self.cfg.max_runs_per_task,
                1 if reasons else 0,
                self._tenant_quota(run),
            )
        except ForkRefused as exc:
            raise self._fork_refusal(run_id, count, exc, reasons) from None
        sent = dispatch.enqueue_fork(self.celery, self.store, run_id, host, job_id, children, run.get("priority"))
        return sent, children

    def _tenant_quota(self, run: dict) -> int | None:
        """max_runs of the run's tenant (None: none), which its forks count against too."""
        tenant = self.cfg.tenants.by_name.get(run.get("tenant") or "")
        return tenant.max_runs if tenant else None

    def _fork_refusal(self, run_id: str, count: int, exc: ForkRefused, reasons: tuple) -> Exception:
        """The error a refused fork answers (the run changed since live_run, or no room)."""
        if exc.code == "UNKNOWN_RUN":
            return UnknownLease(run_id)
        if exc.code == "RUN_CLOSED":
            return RunClosed(f"run {run_id} is {exc.detail}")
        if exc.code == "HOST_LOST":
            return HostUnavailable("HOST_LOST", f"the worker host of run {run_id} is lost")
        if exc.code == "RUN_NOT_READY":
            return NotReady(f"run {run_id} is {exc.detail}; only a started run can be forked")
        if exc.code == "FORK_TOO_DEEP":
            limit = self.cfg.fork_max_depth
            return Refused(
                exc.code, f"run {run_id} is a fork {exc.detail} deep; FORK_MAX_DEPTH ({limit}) allows no deeper"
            )
        if exc.code == "TENANT_QUOTA_EXCEEDED":
            return Refused(exc.code, tenant_quota_message("max_runs"))
        why = f" (the task allows one live run per host: {'; '.join(reasons)})" if reasons else ""
        free = max(int(exc.detail or 0), 0)
        return Refused(
            exc.code,
            f"no capacity for {count} children of run {run_id}: its host has {free} free run slots of its task key{why}",
        )

    # ---- waiting ----------------------------------------------------------------------------
    def wait(self, job_id: str, timeout: float | None) -> dict:
        """Block until the job ends or its limit (plus WAIT_MARGIN) passes."""
        job = self.poll(job_id, None if timeout is None else timeout + WAIT_MARGIN)
        if job is None:
            raise RecordLost(f"job {job_id} vanished: Redis lost its latest writes")
        return job

    def poll(self, job_id: str, seconds: float | None) -> dict | None:
        """The job's record once it has ended or `seconds` passed (None: no limit); a job whose
        host is lost, or whose queue has no live worker, fails meanwhile (settle)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            left = HOST_CHECK_SECONDS if deadline is None else min(HOST_CHECK_SECONDS, deadline - time.monotonic())
            job = self.store.wait_job(job_id, max(left, 0))
            if job is None or job.get("state") not in ("queued", "running"):
                return job
            job = self.settle(job)
            if job.get("state") not in ("queued", "running") or left <= 0:
                return job

    def settle(self, job: dict | None) -> dict | None:
        """Fail an unfinished job at once when its run's host is lost or its queue kind has no
        live worker; the job's record as it stands afterwards."""
        if not job or job.get("state") not in ("queued", "running") or job.get("kind") not in hosts.JOB_QUEUE_KINDS:
            return job
        run = self.store.get_run(job.get("run_id", ""))
        if not run or not run.get("host"):
            return job
        kinds = hosts.JOB_QUEUE_KINDS[job["kind"]]
        code, error = hosts.check(self.store, self.watch, run["host"], kinds)
        if code:
            self.store.fail_lost_job(job["job_id"], error, code=code)
            return self.store.get_job(job["job_id"])
        return job

    def start_wait_limit(self, task_timeouts: dict) -> float:
        t = self.cfg.timeouts.merged(task_timeouts)
        return t.ensure_image + t.reset_session

    def eval_wait_limit(self, run: dict) -> float:
        return self.cfg.timeouts.merged(run.get("task_timeouts")).eval

    @staticmethod
    def tool_wait_limit(call: dict) -> float | None:
        """How long a tool call may take: its own timeout for blocking shell_exec, else short."""
        args = call.get("arguments") or {}
        if call["name"] == "shell_exec" and args.get("block", True) not in (False, None):
            timeout = args.get("timeout", 20.0)
            if timeout is None:
                return None  # the model asked for no limit
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
                return max(float(timeout), 0.0)
        return 30.0

    # ---- the runs API (submit and poll) -----------------------------------------------------
    def submit(
        self, task_key: str, request_id: str, start: dict, episode: dict, tenant=None, priority=None
    ) -> Submission:
        """Allocate (CapacityError when full) and start the run as one episode chain.

        `start` holds the run fields a start reads (task_meta, run_ctx, task_timeouts);
        `episode` the keyword arguments of dispatch.enqueue_episode (script, evaluate, close).
        A retried request (same task_key and request_id) gets the run and start job of the
        first one: the start is claimed with HSETNX on the run record, so two concurrent
        duplicates cannot both start it. A run allocated by /allocate with that request_id
        and never reset is started here.
        """
        self.require_task(start["task_meta"]["task_path"], tenant.name if tenant else None)
        lease = self.allocate(task_key, request_id, start["task_meta"]["task_path"], tenant, priority)
        run = self.store.require_run(lease.run_id)
        job_id = str(uuid.uuid4())
        if run["state"] != "allocated" or not self._claim_start(lease.run_id, job_id):
            return Submission(lease.run_id, self._start_job_of(lease.run_id), run["state"], True)
        self.store.update_run(lease.run_id, state="starting", **NO_FAILURE, **start)
        path = start["task_meta"]["task_path"]
        jobs = dispatch.enqueue_episode(
            self.celery, self.store, lease.run_id, lease.host, job_id, path, **episode, priority=run.get("priority")
        )
        return Submission(lease.run_id, job_id, "starting", lease.reused, jobs)

    def live_run(
        self,
        run_id: str,
        allowed: tuple = STARTED_STATES,
        call_job: str = "",
        job: dict | None = None,
        fields: tuple = (),
    ) -> dict:
        """A run that can take an operation now, marked as used (with call_job: busy until that
        tool call's job ends), in one round trip.

        UnknownLease when there is no such run, RunClosed once released, NotReady in any
        state but `allowed` (starting, failed, or allocated by the pool API and never reset):
        a tool call queued before the start ends would race it on another queue.
        """
        run = self.store.use_run(run_id, call_job, job, fields)
        if run is None:  # unknown, or released
            ended = self.store.get_run(run_id)
            if ended is None:
                raise UnknownLease(run_id)
            raise_if_ended(ended)
            raise RunClosed(f"run {run_id} is {ended['state']}")
        if run["state"] == LOST_STATE:
            raise HostUnavailable(run.get("code") or "HOST_LOST", run.get("error") or f"run {run_id} is lost")
        if run["state"] not in allowed:
            raise NotReady(
                f"run {run_id} is {run['state']}; tool calls and evaluations need a started run "
                f"(state {' / '.join(allowed)})"
            )
        return run

    def last_job(self, run_id: str, kind: str) -> str | None:
        """The newest job of this kind on a run (a close may come from DELETE, /close, the reaper)."""
        for job_id in reversed(self.store.run_jobs(run_id)):
            if (self.store.get_job(job_id) or {}).get("kind") == kind:
                return job_id
        return None

    def _claim_start(self, run_id: str, job_id: str) -> bool:
        """True for exactly one submission of a run: HSETNX is atomic in Redis."""
        return self.store.claim_start(run_id, job_id)

    def _start_job_of(self, run_id: str) -> str | None:
        """The start job a repeated submission answers with: the claimed one, else the newest."""
        return self.store.start_job(run_id) or self.last_job(run_id, "start")
