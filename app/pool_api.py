"""The pool API (docs/http-api.md section 1): byte-compatible with the reference pool server.

Every call blocks until its job has ended, then answers the way the reference does, plus
`code` and `retryable` on every failure (statuses per code: app/error_codes.py). Bodies and
replies are app/models.py's and app/replies.py's.
"""

from __future__ import annotations

from flask import Blueprint

from app import error_codes, fields, idempotency, models, replies, tenancy
from app.engine import NotReady, Refused, RunClosed, UnknownLease
from app.http import engine, fail_on, ok, operation
from app.idempotency import job_once
from app.refusal_texts import capacity_message
from poolcore import failures
from poolcore.state import CapacityError

bp = Blueprint("pool", __name__)
fail = fail_on(error_codes.pool_status)

UNAVAILABLE = (
    "Redis, Docker or the run's worker host could not be reached"
    " (REDIS_UNAVAILABLE, BACKEND_UNAVAILABLE, HOST_LOST, WORKERS_DOWN): retry"
)
# The reference answers 500 for an unknown lease and a run that was not reset; routers expect it.
UNKNOWN_LEASE = "Unknown run_lease_id (code UNKNOWN_LEASE)"


def _job_reply(job: dict, success: type[replies.Reply], **fields):
    if job.get("state") == "succeeded":
        return ok(success(**fields))
    if job.get("state") in ("queued", "running"):
        return fail(
            "TIMEOUT", f"{job.get('kind', 'job')} did not finish in time (job {job['job_id']} is {job['state']})"
        )
    code, error = job.get("code") or "INTERNAL", job.get("error") or "job failed"
    prefix = failures.UNREACHABLE_PREFIX.get(code)  # records of older workers lack it
    if prefix and not error.startswith(prefix):
        error = f"{prefix}: {error}"
    return fail(code, error)


@bp.get("/healthz")
@operation("Liveness.", {200: ("Alive", replies.Reply)})
def healthz():
    return ok()


@bp.get("/readyz")
@operation(
    "Readiness: 200 once a worker host serves every queue kind (an orchestrator's readiness "
    "probe; /healthz is liveness).",
    {
        200: ("Ready", replies.Reply),
        503: "No worker host serves every queue kind yet (code NOT_READY), with the reason",
    },
)
def readyz():
    ready, reason = engine().readiness()
    return ok() if ready else fail("NOT_READY", reason)


@bp.get("/status")
@operation(
    "Capacity and live runs per task key.",
    {200: ("Pool status", replies.StatusReply), 500: "Internal error"},
)
def status():
    tenant = tenancy.current()
    pool = tenancy.tenant_status(engine(), tenant) if tenant else engine().status()
    return ok(replies.StatusReply(pool=pool))


@bp.post("/allocate")
@operation(
    "Lease a run slot for a task key.",
    {
        200: ("Leased", replies.AllocateReply),
        400: "task_key is required, or a field is malformed (code BAD_REQUEST)",
        403: "A priority above the tenant's class (code PRIORITY_NOT_ALLOWED)",
        429: "No capacity; code TASK_SLOTS_EXHAUSTED, RUN_SLOTS_EXHAUSTED, HOST_DISK_LOW or TENANT_QUOTA_EXCEEDED",
    },
    models.AllocateRequest,
)
def allocate(body: models.AllocateRequest):
    try:
        priority = tenancy.run_priority(body.priority)
        lease = engine().allocate(
            body.task_key, fields.text_id(body.request_id), tenant=tenancy.current(), priority=priority
        )
    except CapacityError as exc:
        return fail(exc.code, capacity_message(body.task_key, exc.code, exc.one_per_host, exc.reason))
    tenancy.OWNERS.made(lease.run_id, tenancy.current())
    return ok(replies.AllocateReply(lease_id=lease.run_id, reused=lease.reused))


@bp.post("/heartbeat")
@operation("Mark the lease as used.", {200: ("Done", replies.Reply), 500: UNKNOWN_LEASE}, models.LeaseRequest)
def heartbeat(body: models.LeaseRequest):
    engine().lease(body.lease_id)
    return ok()


@bp.post("/reset")
@operation(
    "Start (or restart) the run's environment and wait for it.",
    {
        200: ("Started", replies.ResetReply),
        500: "Unknown lease, or the start failed; error says why, code what kind of failure",
        503: UNAVAILABLE,
    },
    models.ResetRequest,
)
def reset(body: models.ResetRequest):
    timeouts = body.task_timeouts.given()
    run = engine().lease(body.lease_id)
    job_id = engine().start(run, body.task_meta.model_dump(), body.run_ctx.model_dump(), timeouts)
    job = engine().wait(job_id, engine().start_wait_limit(timeouts))
    result = job.get("result") or {}
    return _job_reply(job, replies.ResetReply, user_msg=result.get("user_msg"), tool_schemas=result.get("tool_schemas"))


@bp.post("/exec_tool")
@operation(
    "Run one tool call and wait for its observation.",
    {
        200: ("Done", replies.ExecToolReply),
        500: "Unknown lease or run not reset; code says which",
        503: UNAVAILABLE,
    },
    models.ExecToolRequest,
    headers=idempotency.DOCUMENTED,
)
def exec_tool(body: models.ExecToolRequest):
    call = body.tool_call.model_dump()
    job_id = job_once(body.lease_id, lambda job: engine().tool_call(body.lease_id, call, job_id=job))
    job = engine().wait(job_id, engine().tool_wait_limit(call))
    return _job_reply(job, replies.ExecToolReply, observation=job.get("result"))


@bp.post("/evaluate")
@operation(
    "Run the task's tests and wait for the score.",
    {
        200: ("Done", replies.EvaluateReply),
        500: "Tests timed out (TESTS_TIMEOUT), output unparsable (TESTS_UNPARSABLE), no reward file (REWARD_MISSING), or run not reset",
        503: UNAVAILABLE,
    },
    models.LeaseRequest,
)
def evaluate(body: models.LeaseRequest):
    run = engine().lease(body.lease_id)
    job_id = engine().evaluation(run)
    job = engine().wait(job_id, engine().eval_wait_limit(run))
    return _job_reply(job, replies.EvaluateReply, score=(job.get("result") or {}).get("score"))


@bp.post("/close")
@operation(
    "Release the lease; the teardown may finish after the reply.",
    {200: ("Done", replies.CloseReply)},
    models.LeaseRequest,
)
def close(body: models.LeaseRequest):
    return ok(replies.CloseReply(found=engine().close(body.lease_id) is not None))


@bp.post("/fork")
@operation(
    "Fork a reset lease into `count` new leases on its host, started from its files as they are now "
    "(an addition to the reference's API).",
    {
        200: ("Forked; the new leases are reset already", replies.ForkReply),
        409: "Forked FORK_MAX_DEPTH deep (FORK_TOO_DEEP)",
        429: "Fewer free run slots of its task key on its host than count (RUN_SLOTS_EXHAUSTED)",
        500: "Unknown lease, lease not reset or closed, or the fork failed; code says which",
        503: UNAVAILABLE,
    },
    models.PoolForkRequest,
)
def fork(body: models.PoolForkRequest):
    run = engine().lease(body.lease_id)
    job_id, children = engine().fork(run["run_id"], body.count)
    job = engine().wait(job_id, engine().start_wait_limit(run.get("task_timeouts") or {}))
    return _job_reply(job, replies.ForkReply, lease_ids=children)


@bp.errorhandler(UnknownLease)
def _unknown_lease(exc):
    return fail("UNKNOWN_LEASE", str(exc))


@bp.errorhandler(Refused)
def _refused(exc):  # HOST_LOST, WORKERS_DOWN (HostUnavailable), RUN_DISK_LIMIT (RunEnded)
    return fail(exc.code, str(exc))


@bp.errorhandler(NotReady)
def _not_ready(exc):
    return fail("RUN_NOT_READY", str(exc))


@bp.errorhandler(RunClosed)
def _closed(exc):
    return fail("RUN_CLOSED", str(exc))
