"""Commands in the runs API: Harbor's `exec(command, cwd, env, timeout_sec, user)` on a run.

  POST   /v1/runs/<run_id>/commands   queue one `bash -c` in the run's agent container: 202
                                      with the job id, refused as a tool call is (404, 409, 503)
  DELETE /v1/jobs/<job_id>            cancel a command job that has not ended

A command job ends `succeeded` with {return_code, stdout, stderr, stdout_truncated,
stderr_truncated, timed_out} whatever the command's exit status (tasks/command_jobs.py); it
fails only when the command could not run as asked (UNKNOWN_USER), was cancelled
(JOB_CANCELLED), or termpool failed. Cancelling answers 202 and returns at once: a queued job
ends failed here, a running one within a fraction of a second, once its worker has killed
everything the command started (environments/commands.py); wait on the job to see it end.
"""

from __future__ import annotations

from flask import Blueprint

from app import command_models, error_codes, idempotency, replies
from app.http import engine, fail_on, ok, operation
from app.idempotency import job_once
from app.runs_api import answer_run_errors

bp = Blueprint("commands", __name__, url_prefix="/v1")
fail = fail_on(error_codes.runs_status)


@bp.post("/runs/<run_id>/commands")
@operation(
    "Queue a command (`bash -c`) in the run's agent container; its job's result has the exit status, stdout and "
    "stderr.",
    {
        202: ("Accepted; poll the job", replies.JobAccepted),
        404: "Unknown run (code UNKNOWN_RUN)",
        409: "Run not started (RUN_NOT_READY) or closing/closed (RUN_CLOSED)",
    },
    command_models.CommandRequest,
    tag="runs",
    headers=idempotency.DOCUMENTED,
)
def create_command(run_id: str, body: command_models.CommandRequest):
    job_id = job_once(run_id, lambda job: engine().command(run_id, body.model_dump(), job_id=job))
    return ok(replies.JobAccepted(job_id=job_id), 202)


@bp.delete("/jobs/<job_id>")
@operation(
    "Cancel a command job: everything the command started is killed and the job fails JOB_CANCELLED.",
    {
        202: (
            "Cancelled; the job ends failed (JOB_CANCELLED) as soon as its processes are gone",
            command_models.Cancelled,
        ),
        200: ("The job had ended already: nothing was done", command_models.NotCancelled),
        404: "Unknown job (code UNKNOWN_JOB)",
        409: "Not a command job (JOB_NOT_CANCELLABLE)",
    },
    tag="runs",
)
def cancel_job(job_id: str):
    state, job = engine().cancel(job_id)
    if job is None:
        return fail("UNKNOWN_JOB", f"unknown job: {job_id}")
    engine().store.touch(job["run_id"])
    if state in ("queued", "running"):
        return ok(command_models.Cancelled(job_id=job_id, cancelled=True), 202)
    return ok(command_models.NotCancelled(job_id=job_id, cancelled=False, state=state or job["state"]))


answer_run_errors(bp)
