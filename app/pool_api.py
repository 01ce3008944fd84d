"""The pool API (docs/http-api.md section 1): byte-compatible with the reference pool server.

Every call blocks until its job has ended, then answers the way the reference does, plus
`code` and `retryable` on every failure (statuses per code: app/error_codes.py).
"""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from app import error_codes, validation
from app.engine import Engine, HostUnavailable, NotReady, UnknownLease, capacity_message
from termpool import failures
from termpool.state import CapacityError

bp = Blueprint("pool", __name__)


def engine() -> Engine:
    return current_app.extensions["termpool"]


def ok(**fields):
    return jsonify({"ok": True, **fields})


def fail(code: str, error: str):
    """A failed reply: its status from the code (app/error_codes.py), `code` and `retryable` added."""
    return jsonify({"ok": False, "error": error, **failures.fields(code)}), error_codes.pool_status(code)


def _job_reply(job: dict, **success_fields):
    if job.get("state") == "succeeded":
        return ok(**success_fields)
    if job.get("state") in ("queued", "running"):
        return fail(
            "TIMEOUT", f"{job.get('kind', 'job')} did not finish in time (job {job['job_id']} is {job['state']})"
        )
    code, error = job.get("code") or "INTERNAL", job.get("error") or "job failed"
    if code == "BACKEND_UNAVAILABLE":  # a worker could not reach its Docker engine
        error = f"Docker is unreachable: {error}"
    return fail(code, error)


@bp.get("/healthz")
def healthz():
    return ok()


@bp.get("/status")
def status():
    return ok(pool=engine().status())


@bp.post("/allocate")
def allocate():
    body = validation.json_body()
    task_key = validation.required_str(body, "task_key")
    request_id = validation.optional_str(body, "request_id")
    try:
        lease = engine().allocate(task_key, request_id)
    except CapacityError as exc:
        return fail(exc.code, capacity_message(task_key, exc.code))
    return ok(lease_id=lease.run_id, reused=lease.reused)


@bp.post("/heartbeat")
def heartbeat():
    run_id = validation.required_str(validation.json_body(), "lease_id")
    engine().lease(run_id)
    return ok()


@bp.post("/reset")
def reset():
    body = validation.json_body()
    run_id = validation.required_str(body, "lease_id")
    cfg = engine().cfg
    meta = validation.task_meta(body, cfg)
    ctx = validation.run_ctx(body, cfg)
    timeouts = validation.task_timeouts(body)
    run = engine().lease(run_id)
    job_id = engine().start(run, meta, ctx, timeouts)
    job = engine().wait(job_id, engine().start_wait_limit(timeouts))
    result = job.get("result") or {}
    return _job_reply(job, user_msg=result.get("user_msg"), tool_schemas=result.get("tool_schemas"))


@bp.post("/exec_tool")
def exec_tool():
    body = validation.json_body()
    run_id = validation.required_str(body, "lease_id")
    call = validation.tool_call(body.get("tool_call"))
    run = engine().lease(run_id)
    job_id = engine().tool_call(run, call)
    job = engine().wait(job_id, engine().tool_wait_limit(call))
    return _job_reply(job, observation=job.get("result"))


@bp.post("/evaluate")
def evaluate():
    run_id = validation.required_str(validation.json_body(), "lease_id")
    run = engine().lease(run_id)
    job_id = engine().evaluation(run)
    job = engine().wait(job_id, engine().eval_wait_limit(run))
    return _job_reply(job, score=(job.get("result") or {}).get("score"))


@bp.post("/close")
def close():
    run_id = validation.required_str(validation.json_body(), "lease_id")
    return ok(found=engine().close(run_id) is not None)


@bp.errorhandler(UnknownLease)
def _unknown_lease(exc):
    return fail("UNKNOWN_LEASE", str(exc))


@bp.errorhandler(HostUnavailable)
def _host_unavailable(exc):
    return fail(exc.code, str(exc))


@bp.errorhandler(NotReady)
def _not_ready(exc):
    return fail("RUN_NOT_READY", str(exc))
