"""Worker-side steps that only one-shot episodes need (see dispatch.enqueue_episode).

An episode is one Celery chain. Celery stops a chain at its first failing step and never
sends the rest, so without help their job records would stay ``queued`` forever and a run
that asked to be closed would keep its containers and capacity slot until the reaper came.
`episode_failed` is the chain's error callback that settles all of that.
"""

from __future__ import annotations

import logging

from celery import shared_task

from poolcore import failures
from poolcore.dispatch import EPISODE_FAILED_TASK, RELEASE_TASK, close_signature
from tasks.job_context import recorded_job
from tasks.runtime import store

log = logging.getLogger(__name__)


@shared_task(name=RELEASE_TASK, bind=True)
@recorded_job
def release_run(self, *, host, run_id, job_id):
    """Free the run's capacity slot before its teardown, as the facade does for /close.

    Runs as the first half of the episode's close job (final=False), so the job shows as
    running from the release until pool.close_run ends it. Releasing an already released
    run (a client DELETE, the reaper) is a no-op; the teardown still runs and is idempotent.
    """
    return store().release(run_id, reason="episode")


@shared_task(name=EPISODE_FAILED_TASK, bind=True)
def episode_failed(self, *, host, run_id, start_job, close_job=""):
    """Error callback of an episode chain: fail the steps that will not run, close if asked.

    Called once, after the failing step's own job record has been marked failed. The
    episode's job ids come from Redis (Store.set_episode_jobs), not from the callback's
    arguments: a copy of the callback rides in every step's message.
    """
    job_ids = store().episode_jobs(start_job)
    jobs = [store().get_job(job_id) or {"job_id": job_id, "state": "gone"} for job_id in job_ids]
    cause, code = _settle_failed_step(jobs)
    for job in jobs:
        if job["state"] == "queued" and job["job_id"] != close_job:
            # Skipped steps carry the failed step's code (is the episode worth a retry?) but
            # are not failures of their own in the failure counts.
            store().job_finished(job["job_id"], error=f"skipped: {cause}", code=code, counted=False)
    _note_run_error(run_id, cause, code)
    if close_job and store().job_state(close_job) == "queued":
        store().release(run_id, reason="episode failed")
        close_signature(self.app, run_id, host, close_job, store().run_priority(run_id)).apply_async()
    return cause


def _settle_failed_step(jobs: list[dict]) -> tuple[str, str]:
    """Describe the step that stopped the episode, with its code; fail it if it died without
    a record.

    A step killed from outside (a hard time limit, a lost worker process) fails the chain
    without its `recorded_job` wrapper recording the end, so it is still ``running`` here.
    """
    for job in jobs:
        if job["state"] == "running":
            store().job_finished(job["job_id"], error="the step ended without recording a result", code="WORKER_LOST")
            job = store().get_job(job["job_id"]) or job
        if job["state"] == "failed":
            return (
                f"the episode stopped at its {job.get('kind')} step (job {job['job_id']} failed)",
                job.get("code") or "INTERNAL",
            )
    return "the episode stopped at a step that left no failure record", "INTERNAL"


def _note_run_error(run_id: str, cause: str, code: str) -> None:
    """Keep the reason a run already has (a failed start or evaluation wrote one); else add ours."""
    run = store().get_run(run_id)
    if run is not None and not run.get("error"):
        store().update_run(run_id, error=cause, **failures.fields(code))
