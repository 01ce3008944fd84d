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
  429  as /allocate: TASK_SLOTS_EXHAUSTED or RUN_SLOTS_EXHAUSTED.

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
    step of a Celery chain carries the rest of the chain in its message.
"""

from __future__ import annotations

import json
import math

from flask import Blueprint, current_app, jsonify, request

from app import error_codes, openapi, validation
from app.engine import Engine, HostUnavailable, NotReady, RunClosed, Submission, UnknownLease, capacity_message
from termpool import failures
from termpool.state import CapacityError

bp = Blueprint("runs", __name__, url_prefix="/v1")

MAX_WAIT = 60.0
MAX_SCRIPT_STEPS = 1000
MAX_SCRIPT_BYTES = 1 << 20
RUN_FIELDS = (
    "run_id",
    "task_key",
    "state",
    "host",
    "created_at",
    "last_used_at",
    "user_msg",
    "tool_schemas",
    "score",
    "tests",
    "error",
    "code",
    "retryable",
)
JOB_FIELDS = (
    "job_id",
    "run_id",
    "kind",
    "state",
    "result",
    "error",
    "code",
    "retryable",
    "attempts",
    "queued_at",
    "started_at",
    "finished_at",
)


def engine() -> Engine:
    return current_app.extensions["termpool"]


def ok(status: int = 200, **fields):
    return jsonify({"ok": True, **fields}), status


def fail(status: int, error: str, code: str):
    return jsonify({"ok": False, "error": error, **failures.fields(code)}), status


# ---- request parsing ------------------------------------------------------------------------
def _flag(body: dict, field: str) -> bool:
    value = body.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise validation.BadRequest(f"{field} must be true or false")
    return value


def _script(body: dict) -> list[dict]:
    """The episode's tool calls, each checked like a pool API tool_call."""
    script = body.get("script")
    if script is None:
        return []
    if not isinstance(script, list):
        raise validation.BadRequest("script must be a list of tool calls {name, arguments}")
    if len(script) > MAX_SCRIPT_STEPS:
        raise validation.BadRequest(f"script has {len(script)} tool calls; at most {MAX_SCRIPT_STEPS} are allowed")
    calls = []
    for i, call in enumerate(script):
        try:
            calls.append(validation.tool_call(call))
        except validation.BadRequest as exc:
            raise validation.BadRequest(f"script[{i}]: {exc}") from None
    if len(json.dumps(calls)) > MAX_SCRIPT_BYTES:
        raise validation.BadRequest(f"script is larger than {MAX_SCRIPT_BYTES} bytes of JSON")
    return calls


def _task_key(body: dict, meta: dict) -> str:
    key = validation.optional_str(body, "task_key") or meta["task_name"]
    return validation.required_str({"task_key": key}, "task_key")


def _wait_seconds() -> float:
    raw = request.args.get("wait")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise validation.BadRequest(f"wait must be a number of seconds from 0 to {MAX_WAIT:g}") from None
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_WAIT:
        raise validation.BadRequest(f"wait must be a number of seconds from 0 to {MAX_WAIT:g}")
    return seconds


# ---- replies --------------------------------------------------------------------------------
def _with_failure(view: dict, record: dict) -> dict:
    """error, code and retryable: null unless the record holds a failure (the store keeps "")."""
    view["error"] = record.get("error") or None
    view["code"] = record.get("code") or None
    view["retryable"] = record.get("retryable") if view["code"] else None
    return view


def _run_view(run: dict) -> dict:
    view = _with_failure({field: run.get(field) for field in RUN_FIELDS}, run)
    view["jobs"] = engine().store.run_jobs(run["run_id"])
    return view


def _job_view(job: dict) -> dict:
    return _with_failure({field: job.get(field) for field in JOB_FIELDS}, job)


def _submission_reply(sub: Submission):
    reply = {"run_id": sub.run_id, "job_id": sub.job_id, "state": sub.state, "reused": sub.reused}
    if sub.jobs is not None:
        reply["jobs"] = sub.jobs
    return ok(202, **reply)


# ---- endpoints ------------------------------------------------------------------------------
@bp.post("/runs")
def create_run():
    """Allocate and start a run; with script/evaluate/close, the whole episode as one chain."""
    body = validation.json_body()
    cfg = engine().cfg
    meta = validation.task_meta(body, cfg)
    start = {
        "task_meta": meta,
        "run_ctx": validation.run_ctx(body, cfg),
        "task_timeouts": validation.task_timeouts(body),
    }
    episode = {"script": _script(body), "evaluate": _flag(body, "evaluate"), "close": _flag(body, "close")}
    task_key = _task_key(body, meta)
    request_id = validation.optional_str(body, "request_id")
    try:
        sub = engine().submit(task_key, request_id, start, episode)
    except CapacityError as exc:
        return fail(error_codes.runs_status(exc.code) or 429, capacity_message(task_key, exc.code), exc.code)
    return _submission_reply(sub)


@bp.get("/runs/<run_id>")
def get_run(run_id: str):
    run = engine().store.get_run(run_id)
    if run is None:
        raise UnknownLease(run_id)
    engine().store.touch(run_id)
    return ok(run=_run_view(run))


@bp.post("/runs/<run_id>/tool_calls")
def create_tool_call(run_id: str):
    call = validation.tool_call(validation.json_body())
    run = engine().live_run(run_id)
    return ok(202, job_id=engine().tool_call(run, call))


@bp.post("/runs/<run_id>/evaluation")
def create_evaluation(run_id: str):
    run = engine().live_run(run_id)
    return ok(202, job_id=engine().evaluation(run))


@bp.delete("/runs/<run_id>")
def delete_run(run_id: str):
    """Release the run and queue its teardown; repeating it is harmless (see module doc)."""
    run = engine().store.get_run(run_id)
    if run is None:
        raise UnknownLease(run_id)
    job_id = engine().close(run_id)
    if job_id is not None:
        return ok(202, job_id=job_id, found=True)
    run = engine().store.require_run(run_id)
    return ok(job_id=engine().last_job(run_id, "close"), found=False, state=run["state"])


@bp.get("/jobs/<job_id>")
def get_job(job_id: str):
    """A job's record; with ?wait=S, held until the job ends (BLMOVE, no polling) or S pass."""
    seconds = _wait_seconds()
    job = engine().store.get_job(job_id)
    if job is None:
        return fail(404, f"unknown job: {job_id}", "UNKNOWN_JOB")
    engine().store.touch(job["run_id"])
    job = engine().poll(job_id, seconds) or job  # settles a job whose host is lost
    return ok(job=_job_view(job))


# ---- errors and the API document -------------------------------------------------------------
@bp.errorhandler(UnknownLease)
def _unknown_run(exc):
    return fail(404, str(exc), "UNKNOWN_RUN")


@bp.errorhandler(NotReady)
def _not_ready(exc):
    return fail(409, str(exc), "RUN_NOT_READY")


@bp.errorhandler(HostUnavailable)
def _host_unavailable(exc):
    return fail(503, str(exc), exc.code)


@bp.errorhandler(RunClosed)
def _closed(exc):
    return fail(409, str(exc), "RUN_CLOSED")


@bp.record_once
def _serve_openapi(state) -> None:
    """GET /openapi.json lives outside /v1 (it documents both faces), so it goes on the app."""
    state.app.add_url_rule("/openapi.json", "openapi", lambda: jsonify(openapi.document()))
