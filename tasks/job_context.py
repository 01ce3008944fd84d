"""What every job of a run shares, whichever module holds it: the wrapper that records a job's
start and end (`recorded_job`: its code, Celery retries of transient Docker failures, work
deferred past the reply), the lookups of a live run and its started environment, and where a
run's task folder, artifacts and time limits are."""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
from pathlib import Path

import docker.errors
import requests.exceptions

from environments import artifacts, lifecycle
from environments.docker_client import (
    KnownContainer,
    docker_client,
    never_reached_engine,
    says_not_running,
    wait_for_engine,
)
from poolcore import failures
from poolcore.config import settings
from poolcore.state import STARTED_STATES, UNAVAILABLE
from tasks import lost_jobs, task_folders
from tasks.runtime import store, through_outage


class RunClosed(failures.Failure):
    code = "RUN_CLOSED"


class RunNotStarted(failures.Failure):
    code = "RUN_NOT_READY"


class HandedOver(Exception):
    """The job was re-queued to other tasks, which will end it."""


class Transient(Exception):
    """Raised in place of a transient failure to have Celery retry the task (autoretry_for)."""


# Automatic retries of transient Docker failures: Celery's autoretry with exponential backoff
# and full jitter (waits of up to 2, 4, 8 s). Only tasks whose work can be redone safely opt in.
RETRY_OPTIONS = dict(
    autoretry_for=(Transient,), max_retries=3, retry_backoff=2, retry_backoff_max=30, retry_jitter=True
)
NO_RETRY = "termpool_no_retry"  # set on an exception raised inside `committed()`

log = logging.getLogger(__name__)
_deferred = threading.local()  # this worker thread's job's after_reply work


def after_reply(fn) -> None:
    """Run `fn` once the current job's end is recorded (its client has the answer): work
    nobody waits for. A failure there is logged, never the job's."""
    _deferred.calls.append(fn)


def _run_deferred(calls: list) -> None:
    for fn in calls:
        try:
            fn()
        except Exception:
            log.exception("work deferred past a job's reply failed")


@contextlib.contextmanager
def committed():
    """From here on the task's work may have had effects (tests started): never retry it."""
    try:
        yield
    except Exception as exc:
        setattr(exc, NO_RETRY, True)
        raise


def transient(exc: BaseException) -> bool:
    """A Docker hiccup worth another try: a 5xx answer, a connection reset or refused, an HTTP
    timeout. Never a task error, nor one of termpool's own time limits (they used the budget)."""
    if isinstance(exc, failures.Failure):
        return exc.code == "DOCKER_ERROR"
    if isinstance(exc, docker.errors.APIError):
        return exc.is_server_error()
    return isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError))


def recorded_job(fn=None, *, on_failure=None, retry=False):
    """Record the job's start and end around a task body; the last step of a chain ends it.

    A failure is recorded with its code (failures.classify) and then `on_failure(run_id,
    error, code)` runs (a failed start marks the run failed). With retry=True a transient
    failure (see `transient`) before the body's `committed()` block is retried by Celery
    instead: the job stays running, with one attempt more; the task must be declared with
    RETRY_OPTIONS.
    """
    if fn is None:
        return functools.partial(recorded_job, on_failure=on_failure, retry=retry)

    @functools.wraps(fn)
    def wrapper(self, *, host, run_id, job_id, final=True, **kwargs):
        # Running now if queued, listed under this process until it ends here (lost_jobs), once
        # per message: a copy (a publish retried, a redelivery) is dropped; one taker (nonce) for
        # every try of the begin (through_outage), so the begin's own retry goes on.
        delivery, taker = f"{self.request.id}:{self.request.retries}", secrets.token_hex(8)
        node, resend = self.request.hostname or "", lost_jobs.resendable(self)
        begin = functools.partial(store().begin_job, job_id, node, lost_jobs.TOKEN, resend, delivery, taker)
        state = through_outage(begin, f"job {job_id}'s start")
        if state == "duplicate":
            log.warning("job %s: a copy of its message %s was dropped", job_id, self.request.id)
            return None
        if state in ("succeeded", "failed"):
            return None  # settled already (failed as lost, or its run closed): a late copy of its message
        ended, settle = False, {"worker": lost_jobs.TOKEN}
        _deferred.calls = deferred = []
        try:
            try:
                result = _through_engine_restart(fn, self, retry, host=host, run_id=run_id, job_id=job_id, **kwargs)
            except HandedOver:
                return None  # another task carries this job on
            except Exception as exc:
                lost = _container_lost(run_id, exc)
                code = failures.classify(lost or exc)
                error = failures.describe(lost or exc, code)
                if (
                    retry
                    and not lost
                    and not getattr(exc, NO_RETRY, False)
                    and transient(exc)
                    and self.request.retries < self.max_retries
                ):
                    store().job_retrying(job_id, self.name, code, error, retries=self.request.retries + 1)
                    raise Transient(error) from exc
                if on_failure:  # the run's state must follow the job's end: it waits out an outage too
                    through_outage(lambda: on_failure(run_id, error, code), f"run {run_id} after job {job_id}")
                ended = True
                _record_end(job_id, error=error, code=code, **settle)
                if lost is not None and lost is not exc:
                    raise lost from exc
                raise
            if final:
                ended = True
                _record_end(job_id, result=result, **settle)
            return result
        finally:
            if not ended:  # handed over, retried, or a step that does not end the job
                store().job_left(job_id, lost_jobs.TOKEN)
            _run_deferred(deferred)

    return wrapper


def _through_engine_restart(fn, task, retry: bool, **kwargs):
    """The job's body; when it finds the Docker engine away (a restart), it waits for the
    engine (DOCKER_OUTAGE_SECONDS) before the job fails or is retried, so the failure says
    what the engine's return showed (CONTAINER_LOST when the run's container died with it).
    A job that is never retried (a tool call, a command) runs its body once more when its
    failed request never reached the engine: nothing of it ran, and on an engine with
    live-restore the run's container is still there."""
    try:
        return fn(task, **kwargs)
    except Exception as exc:
        if isinstance(exc, HandedOver) or failures.classify(exc) != "BACKEND_UNAVAILABLE":
            raise
        # Once per job: a retry that finds the engine still away after that wait is on Celery's
        # backoff, so an engine that is gone for good costs a reset one wait, not one per try.
        if task.request.retries or not wait_for_engine(settings().docker_outage_seconds):
            raise
        lost = _container_lost(kwargs["run_id"], exc)
        if lost is not None:
            raise lost from exc
        if retry or not never_reached_engine(exc):
            raise
        log.warning("job %s: the Docker engine was away and is back; its call runs again", kwargs["job_id"])
        return fn(task, **kwargs)


def _container_lost(run_id: str, exc: Exception) -> failures.ContainerLost | None:
    """What a job on a started run met when its client container no longer runs (its Docker
    engine restarted without live-restore, or it was removed), whatever Docker's refusal looked
    like: the run is marked lost with CONTAINER_LOST, so every later call on it answers that at
    once and the host's next reconcile closes it. None while the container runs, or when Docker
    cannot be asked (it is away: the failure says that itself)."""
    if isinstance(exc, (RunClosed, RunNotStarted, HandedOver)):
        return None
    known = exc if isinstance(exc, failures.ContainerLost) else None
    try:
        run = store().get_run(run_id) or {}
        client = (run.get("env") or {}).get("client")
        if run.get("state") not in STARTED_STATES or not client:
            return known
        if known is None and not says_not_running(exc) and lifecycle.is_running(client):
            return None
        lost = known or failures.ContainerLost(f"run {run_id}: its container {client} no longer runs")
        store().mark_run_lost(run_id, str(lost), STARTED_STATES, code=lost.code)
        return lost
    except (UNAVAILABLE, docker.errors.DockerException, requests.exceptions.RequestException):
        return known


def _record_end(job_id: str, **fields) -> None:
    """Write a job's end, again while Redis cannot be reached (an outage, a partition): the work
    is done and its caller waits for exactly this write; nothing else would ever end the job,
    since its live process still holds it. Writing twice is harmless (the second is a late end)."""
    through_outage(lambda: store().job_finished(job_id, **fields), f"job {job_id}'s end")


def run_task_dir(run: dict) -> Path:
    return task_folders.task_dir(run["task_meta"]["task_path"])


def run_timeouts(run: dict):
    return settings().timeouts.merged(run.get("task_timeouts"))


def live_run(run_id: str, call_job: str = "") -> dict:
    """The run's record, marked as used (with call_job, busy until that tool call's job ends:
    Store.use_run): a run whose job is working is in use, whoever polls it."""
    run = store().use_run(run_id, call_job) or store().require_run(run_id)  # the second: unknown, or closed
    if run["state"] in ("closing", "closed"):
        raise RunClosed(f"run {run_id} is closed")
    return run


def started_env(run: dict) -> dict:
    """The environment of a started run (RunNotStarted before its reset)."""
    env = run.get("env")
    if not env or run["state"] in ("allocated", "starting"):
        raise RunNotStarted(f"run {run['run_id']} has not been reset")
    return env


def client_container(env: dict) -> KnownContainer:
    """The run's client container, from its environment: no inspect call per tool call."""
    return KnownContainer(docker_client(), env["client"], env.get("user", ""))


def artifacts_dir(run: dict, mounts_from: Path | None = None) -> Path:
    ctx = run.get("run_ctx") or {}
    log_dir = ctx.get("log_dir") or str(settings().default_log_dir)
    return artifacts.run_dir(
        log_dir, run["task_meta"]["task_name"], str(ctx.get("uid", "0")), run["run_id"], mounts_from
    )
