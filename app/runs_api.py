"""The runs API (docs/http-api.md section 2): submit and poll by run id and job id.

Every operation answers at once with an id; the client polls GET /v1/jobs/<id>, or
long-polls it with ``?wait=S``. Runs and jobs are the same records the pool API uses, so a
lease allocated through /allocate is a run here and a run submitted here is a lease there.

Statuses (every body is JSON with ``ok``; failures carry ``error``, a ``code`` and
``retryable``; a failed job's record carries them too, see app/error_codes.py):
  202  the operation was accepted; its job id is in the reply.
  200  reads, and a repeated DELETE (see below).
  400  bad input (app/errors.py), checked before anything else happens, so a bad request
       never takes a capacity slot.
  404  UNKNOWN_RUN / UNKNOWN_JOB: no such id (records of ended runs and jobs stay 24 h).
  409  RUN_NOT_READY: a tool call or evaluation on a run that is not started (``starting``,
       ``failed``, or allocated through the pool API and never reset). Wait for the start
       job instead of racing it: the start and the tool call would run on different queues.
       RUN_CLOSED: any operation on a run that is ``closing`` or ``closed``.
       FORK_TOO_DEEP: a fork of a run that is a fork FORK_MAX_DEPTH deep.
  429  as /allocate: TASK_SLOTS_EXHAUSTED, RUN_SLOTS_EXHAUSTED or HOST_DISK_LOW (a fork: too
       few free slots of the run's task key on its host).
  503  HOST_LOST: the run's worker host is lost; WORKERS_DOWN: no live worker consumes the
       queue the call needs (or, on POST /v1/runs, no host takes new runs). At once, not
       after the call's time limit; a job already queued or running fails with the same code.

Decisions where the spec is silent:
  * POST /v1/runs with the ``request_id`` of an earlier submission (same task_key, within
    300 s, run still live) starts nothing: it answers 202 with the same run_id and start
    job_id and ``reused: true``. The body of the repeat is not compared with the first.
  * DELETE is idempotent. The first DELETE releases the run and answers 202 with the close
    job. A DELETE of a run that is already closing or closed answers 200 with
    ``found: false`` and the newest close job (null if none), so a client whose first
    DELETE was lost can still wait for the teardown.
  * ``?wait`` must be a number from 0 to 60; anything else is a 400, not clamped.
  * Reading a run or one of its jobs is a call on its lease (docs/http-api.md: "any call"), so it
    marks a live run as used. Every job a worker starts marks its run as used too, so a long
    one-shot episode is not reaped as idle between its steps.
  * The 202 of POST /v1/runs also carries ``reused`` and, when this request started the
    run, ``jobs``: every step's job id (start, tool_calls, evaluation, close), so a client
    can wait on the last one. A repeat may briefly name a start job whose record is still
    being written (a 404 for a few milliseconds).
  * ``script`` holds at most MAX_SCRIPT_STEPS tool calls and MAX_SCRIPT_BYTES of JSON: each
    step of a Celery chain carries the rest of the chain in its message (app/fields.py).
"""

from __future__ import annotations

from flask import Blueprint, request
from pydantic import TypeAdapter, ValidationError

from app import error_codes, fields, idempotency, models, replies, tenancy
from app.engine import NotReady, Refused, RunClosed, Submission, UnknownLease
from app.http import BadRequest, engine, fail_on, ok, operation
from app.idempotency import job_once
from app.refusal_texts import capacity_message
from poolcore.state import CapacityError

bp = Blueprint("runs", __name__, url_prefix="/v1")
fail = fail_on(error_codes.runs_status)

WAIT = TypeAdapter(fields.WaitSeconds)
UNKNOWN_RUN = "Unknown run (code UNKNOWN_RUN)"
WRONG_STATE = "Run not started (RUN_NOT_READY) or closing/closed (RUN_CLOSED)"
ACCEPTED = ("Accepted; poll the job", replies.JobAccepted)


def _wait_seconds() -> float:
    raw = request.args.get("wait")
    if raw is None:
        return 0.0
    try:
        return WAIT.validate_python(raw)
    except ValidationError:
        raise BadRequest(f"wait must be a number of seconds from 0 to {fields.MAX_WAIT:g}") from None


# ---- replies --------------------------------------------------------------------------------
def _view(model: type, record: dict, **more) -> dict:
    """The model's fields of a stored record; error, code and retryable are null unless the
    record holds a failure (the store keeps "")."""
    view = {name: record.get(name) for name in model.model_fields} | more
    view["error"] = record.get("error") or None
    view["code"] = record.get("code") or None
    view["retryable"] = record.get("retryable") if view["code"] else None
    return model(**view)


def _submission_reply(sub: Submission):
    fields = {"run_id": sub.run_id, "job_id": sub.job_id, "state": sub.state, "reused": sub.reused}
    if sub.jobs is not None:  # only when this request started the run
        fields["jobs"] = sub.jobs
    return ok(replies.Submitted(**fields), 202)


# ---- endpoints ------------------------------------------------------------------------------
@bp.post("/runs")
@operation(
    "Allocate and start a run; optionally a whole episode in one request.",
    {
        202: ("Accepted; job_id is the start job, jobs lists every step", replies.Submitted),
        403: "A priority above the tenant's class (code PRIORITY_NOT_ALLOWED)",
        429: "No capacity, as /allocate",
    },
    models.RunRequest,
    tag="runs",
)
def create_run(body: models.RunRequest):
    """Allocate and start a run; with script/evaluate/close, the whole episode as one chain."""
    start = {
        "task_meta": body.task_meta.model_dump(),
        "run_ctx": body.run_ctx.model_dump(),
        "task_timeouts": body.task_timeouts.given(),
    }
    script = [call.model_dump() for call in body.script or []]
    episode = {"script": script, "evaluate": body.evaluate, "close": body.close}
    task_key = body.capacity_key()
    try:
        priority = tenancy.run_priority(body.priority)
        sub = engine().submit(task_key, fields.text_id(body.request_id), start, episode, tenancy.current(), priority)
    except CapacityError as exc:
        return fail(exc.code, capacity_message(task_key, exc.code, exc.one_per_host, exc.reason))
    return _submission_reply(sub)


@bp.get("/runs/<run_id>")
@operation("A run's record.", {200: ("The run", replies.RunReply), 404: UNKNOWN_RUN}, tag="runs")
def get_run(run_id: str):
    run = engine().store.shown_run(run_id)
    if run is None:
        raise UnknownLease(run_id)
    engine().store.touch(run_id)
    jobs = engine().store.run_jobs(run_id)
    return ok(replies.RunReply(run=_view(replies.Run, run, jobs=jobs)))


@bp.post("/runs/<run_id>/tool_calls")
@operation(
    "Queue one tool call.",
    {202: ACCEPTED, 404: UNKNOWN_RUN, 409: WRONG_STATE},
    models.ToolCall,
    root="tool_call",
    tag="runs",
    headers=idempotency.DOCUMENTED,
)
def create_tool_call(run_id: str, body: models.ToolCall):
    job_id = job_once(run_id, lambda job: engine().tool_call(run_id, body.model_dump(), runs_api=True, job_id=job))
    return ok(replies.JobAccepted(job_id=job_id), 202)


@bp.post("/runs/<run_id>/evaluation")
@operation(
    "Queue the task's tests (a body, if any, is ignored).",
    {202: ACCEPTED, 400: "A malformed Idempotency-Key (code BAD_REQUEST)", 404: UNKNOWN_RUN, 409: WRONG_STATE},
    tag="runs",
    headers=idempotency.DOCUMENTED,
)
def create_evaluation(run_id: str):
    job_id = job_once(run_id, lambda job: engine().evaluation(engine().live_run(run_id), job_id=job))
    return ok(replies.JobAccepted(job_id=job_id), 202)


@bp.post("/runs/<run_id>/fork")
@operation(
    "Fork a started run: `count` new runs on its host whose services start from its files as they are now.",
    {
        202: ("Accepted; the children are starting until the fork job ends", replies.ForkAccepted),
        404: UNKNOWN_RUN,
        409: "Run not started (RUN_NOT_READY), closing/closed (RUN_CLOSED), or forked FORK_MAX_DEPTH deep "
        "(FORK_TOO_DEEP)",
        429: "Fewer free run slots of its task key on its host than count (RUN_SLOTS_EXHAUSTED)",
    },
    models.ForkRequest,
    tag="runs",
    headers=idempotency.DOCUMENTED,
)
def fork_run(run_id: str, body: models.ForkRequest):
    forked = {}

    def fork(job: str) -> str:
        job_id, forked["children"] = engine().fork(run_id, body.count, job_id=job)
        return job_id

    job_id = job_once(run_id, fork)
    children = forked.get("children") or (engine().store.get_job(job_id) or {}).get("children") or []
    return ok(replies.ForkAccepted(job_id=job_id, run_ids=children), 202)


@bp.delete("/runs/<run_id>")
@operation(
    "Release the run and tear it down (idempotent).",
    {
        202: ("Released; job_id is the teardown", replies.Released),
        200: ("Already closing or closed; job_id is the newest close job", replies.AlreadyReleased),
        404: UNKNOWN_RUN,
    },
    tag="runs",
)
def delete_run(run_id: str):
    """Release the run and queue its teardown; repeating it is harmless (see module doc)."""
    run = engine().store.get_run(run_id)
    if run is None:
        raise UnknownLease(run_id)
    job_id = engine().close(run_id)
    if job_id is not None:
        return ok(replies.Released(job_id=job_id, found=True), 202)
    run = engine().store.require_run(run_id)
    last = engine().last_job(run_id, "close")
    return ok(replies.AlreadyReleased(job_id=last, found=False, state=run["state"]))


@bp.get("/jobs/<job_id>")
@operation(
    "A job's record, optionally long-polled.",
    {
        200: ("The job (maybe still queued or running when wait ran out)", replies.JobReply),
        400: f"wait is not a number from 0 to {fields.MAX_WAIT:g} (code BAD_REQUEST)",
        404: "Unknown job (code UNKNOWN_JOB)",
    },
    query={"wait": ("Hold the request until the job has ended or this many seconds have passed.", WAIT)},
    tag="runs",
)
def get_job(job_id: str):
    """A job's record; with ?wait=S, held until the job ends (BLMOVE, no polling) or S pass."""
    seconds = _wait_seconds()
    job = engine().store.get_job(job_id)
    if job is None:
        return fail("UNKNOWN_JOB", f"unknown job: {job_id}")
    engine().store.touch(job["run_id"])
    job = engine().poll(job_id, seconds) or job  # settles a job whose host is lost
    return ok(replies.JobReply(job=_view(replies.Job, job)))


# ---- errors ---------------------------------------------------------------------------------
def answer_run_errors(blueprint: Blueprint) -> None:
    """How a runs API blueprint answers the engine's refusals (by their codes): this one's, and
    the commands' and archives' (app/commands_api.py, app/archives_api.py)."""

    @blueprint.errorhandler(UnknownLease)
    def _unknown_run(exc):
        return fail("UNKNOWN_RUN", str(exc))

    @blueprint.errorhandler(NotReady)
    def _not_ready(exc):
        return fail("RUN_NOT_READY", str(exc))

    @blueprint.errorhandler(Refused)
    def _refused(exc):  # HOST_LOST, WORKERS_DOWN (HostUnavailable), RUN_DISK_LIMIT (RunEnded), ...
        return fail(exc.code, str(exc))

    @blueprint.errorhandler(RunClosed)
    def _closed(exc):
        return fail("RUN_CLOSED", str(exc))


answer_run_errors(bp)
