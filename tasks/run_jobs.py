"""Celery tasks: every operation on a run, carried out on the run's host.

Each task carries the job id of the client's request; `_job` records started/finished in
the state store so the facade (and pollers) see the outcome whatever the queue did, a
failure with its code (termpool/failures.py), and retries transient Docker failures of the
tasks that can safely run again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
import time
from pathlib import Path

import docker.errors
import requests.exceptions
from celery import chain, shared_task

from environments import artifacts, harbor_verifier, lifecycle, task_builds
from environments.docker_client import (
    KnownContainer,
    docker_client,
    never_reached_engine,
    says_not_running,
    wait_for_engine,
)
from environments.evaluation import copy_tests, run_tests
from environments.session_helper import prepare_container
from environments.tools import run_tool, tool_schemas
from tasks import image_budget, lost_jobs, run_folders, task_folders, warm_pool
from tasks.runtime import remove_env, store, subnet_taker, through_outage
from termpool import disk, failures, priorities
from termpool.config import settings
from termpool.harbor_task import is_harbor_folder
from termpool.state import NO_FAILURE, STARTED_STATES, UNAVAILABLE
from termpool.task_spec import TaskError, Unsupported, load_task_cached
from termpool.uploaded_tasks import docker_task_name


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


def _job(fn=None, *, on_failure=None, retry=False):
    """Record the job's start and end around a task body; the last step of a chain ends it.

    A failure is recorded with its code (failures.classify) and then `on_failure(run_id,
    error, code)` runs (a failed start marks the run failed). With retry=True a transient
    failure (see `transient`) before the body's `committed()` block is retried by Celery
    instead: the job stays running, with one attempt more; the task must be declared with
    RETRY_OPTIONS.
    """
    if fn is None:
        return functools.partial(_job, on_failure=on_failure, retry=retry)

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


def _failed(exc: BaseException) -> dict:
    """A failure's code and text, as a job record and results.json carry them."""
    code = failures.classify(exc)
    return {"error": failures.describe(exc, code), "code": code}


def _start_failed(run_id: str, error: str, code: str) -> None:
    store().set_state_if_live(run_id, "failed", error=error, **failures.fields(code))


def _task_dir(run: dict) -> Path:
    return task_folders.task_dir(run["task_meta"]["task_path"])


def _spec(task_dir: Path):
    try:
        return load_task_cached(task_dir)
    except Unsupported as exc:
        raise failures.TaskUnsupported(str(exc)) from exc
    except TaskError as exc:
        raise failures.TaskInvalid(str(exc)) from exc


def _timeouts(run: dict):
    return settings().timeouts.merged(run.get("task_timeouts"))


def _live_run(run_id: str, call_job: str = "") -> dict:
    """The run's record, marked as used (with call_job, busy until that tool call's job ends:
    Store.use_run): a run whose job is working is in use, whoever polls it."""
    run = store().use_run(run_id, call_job) or store().require_run(run_id)  # the second: unknown, or closed
    if run["state"] in ("closing", "closed"):
        raise RunClosed(f"run {run_id} is closed")
    return run


def _started_env(run: dict) -> dict:
    """The environment of a started run (RunNotStarted before its reset)."""
    env = run.get("env")
    if not env or run["state"] in ("allocated", "starting"):
        raise RunNotStarted(f"run {run['run_id']} has not been reset")
    return env


def _client_container(env: dict) -> KnownContainer:
    """The run's client container, from its environment: no inspect call per tool call."""
    return KnownContainer(docker_client(), env["client"], env.get("user", ""))


class _RunSessions:
    """Shell-session bookkeeping of one run, kept in Redis so any worker can continue it."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def get(self, sid: str) -> dict:
        return store().session(self.run_id, sid)

    def set(self, sid: str, **fields) -> None:
        store().update_session(self.run_id, sid, **fields)


# ---- reset ----------------------------------------------------------------------------------
@shared_task(name="pool.ensure_image", bind=True, **RETRY_OPTIONS)
@_job(on_failure=_start_failed, retry=True)
def ensure_image(self, *, host, run_id, job_id):
    run = _live_run(run_id)
    limit = _timeouts(run).ensure_image
    task_dir = _task_dir(run)
    harbor = _spec(task_dir).harbor if is_harbor_folder(task_dir) else None
    if harbor is not None:  # its build_timeout_sec, within termpool's limit (the facade waits that long)
        limit = min(limit, harbor.build_timeout_sec)
    cfg = settings()
    try:
        image = task_builds.ensure_image(
            docker_task_name(run["task_meta"]),
            task_dir,
            cfg,
            limit,
            functools.partial(store().build_lock, cfg.host_id),
            store(),
        )
    except TimeoutError as exc:
        if harbor is None or limit < harbor.build_timeout_sec:
            raise  # termpool's own limit: TIMEOUT, worth another try
        # The task's own limit, as Harbor fails a trial whose build passes it: the task's fault.
        raise failures.TaskBuildFailed(f"{exc} (task.toml's build_timeout_sec)") from None
    store().mark_image_ready(host, run["task_meta"]["task_path"])
    image_budget.note_built(host, image, run["task_meta"]["task_path"])
    return image


@shared_task(name="pool.start_run", bind=True, **RETRY_OPTIONS)
@_job(on_failure=_start_failed, retry=True)
def start_run(self, *, host, run_id, job_id, first_try=True):
    run = _live_run(run_id)
    if run.get("env") or self.request.retries:  # a second reset, or a retry of a lost start
        remove_env(run_id, run.get("env") or {})  # replaces the old (or half-made) environment
        store().drop_sessions(run_id)
    meta = run["task_meta"]
    task_dir = _task_dir(run)
    spec = _spec(task_dir)
    limit = _timeouts(run).ensure_image
    if first_try and not task_builds.images_current(docker_task_name(meta), task_dir, settings(), limit):
        warm_pool.discard(host, meta["task_path"])  # the task changed since its image was built
        _build_then_start(self.app, host, run_id, meta["task_path"], job_id)
    pooled = settings().warm_pool_size > 0  # off: no claim, no demand noted, no refill job sent
    env = warm_pool.claim(run, host, _run_path) if pooled and first_try else None
    if env is not None:  # served by a spare: its demand is noted (and a refill sent) after the reply
        after_reply(functools.partial(warm_pool.demanded, self.app, run, host, served=True))
    elif pooled and lifecycle.warm_capable(task_dir, settings()):  # a pooled task (no compose call):
        warm_pool.demanded(self.app, run, host, served=False)  # its spares start beside this cold start
    disk_limit = disk.run_limit(settings().container_disk_limit, spec.disk_limit_mb)
    if env is None:
        try:
            env = _start_cold(run, task_dir, disk_limit)
        except docker.errors.ImageNotFound:
            if not first_try:
                raise
            _build_then_start(self.app, host, run_id, meta["task_path"], job_id)  # removed since built
    instruction = meta.get("instruction") or spec.instruction
    reply = {
        "user_msg": f"Task name:{meta['task_name']}\nTask instruction: {instruction}",
        "tool_schemas": tool_schemas(settings().expose_kill_tool),
    }
    try:
        ready = store().set_state_if_live(
            run_id,
            "ready",
            env=env.to_dict(),
            score=None,
            tests=None,
            rewards=None,
            disk_limit=disk_limit,
            **NO_FAILURE,
            **reply,
        )
    except Exception:  # not recorded (Redis away or full): nothing would ever remove it
        remove_env(run_id, env.to_dict())
        raise
    if not ready:
        remove_env(run_id, env.to_dict())  # closed while starting
        raise RunClosed(f"run {run_id} was closed while it was starting")
    after_reply(functools.partial(image_budget.note_started, host, meta["task_path"], env.client))
    return reply


def _build_then_start(app, host: str, run_id: str, task_path: str, job_id: str) -> None:
    """Hand the start over to a build of the task's images, then a start (its second try)."""
    store().mark_image_ready(host, task_path, False)
    ids = dict(host=host, run_id=run_id, job_id=job_id)
    options = dict(immutable=True, priority=priorities.level(store().run_priority(run_id)))  # as its first try's
    build = app.signature("pool.ensure_image", kwargs=dict(**ids, final=False), **options)
    chain(build, app.signature("pool.start_run", kwargs=dict(**ids, first_try=False), **options)).apply_async()
    raise HandedOver()


def _run_path(run: dict, mounts_from: Path | None = None) -> Path:
    ctx = run.get("run_ctx") or {}
    log_dir = ctx.get("log_dir") or str(settings().default_log_dir)
    return artifacts.run_dir(
        log_dir, run["task_meta"]["task_name"], str(ctx.get("uid", "0")), run["run_id"], mounts_from
    )


def _start_cold(run: dict, task_dir: Path, disk_limit: int) -> lifecycle.RunEnv:
    env, container = lifecycle.start(
        run,
        task_dir,
        _run_path(run),
        settings(),
        _timeouts(run).reset_session,
        disk_limit=disk_limit,
        subnets=subnet_taker(run["run_id"]),
    )
    if not env.booted:  # else its tool server started with it (tp-session boot)
        try:
            prepare_container(container, serve=bool(env.ctl_dir))
        except BaseException:
            remove_env(run["run_id"], env.to_dict())
            raise
    return env


@shared_task(name="pool.exec_tool", bind=True)
@_job
def exec_tool(self, *, host, run_id, job_id, tool_call, env=None):
    """`env` is the run's environment as the facade read it when it took the call (an
    episode's steps, queued before the start, read the run here): no Redis read per call."""
    given = env is not None
    env = env or _started_env(_live_run(run_id, call_job=job_id))
    started = time.monotonic()
    try:
        observation = run_tool(
            _client_container(env),
            tool_call.get("name"),
            tool_call.get("arguments"),
            _RunSessions(run_id),
            expose_kill=settings().expose_kill_tool,
            ctl_socket=lifecycle.ctl_socket(env) or None,
            workdir=env.get("workdir", ""),
        )
    except Exception:
        if given:  # a run closed since the facade took the call answers that, whatever Docker said
            _live_run(run_id)
        raise
    seconds = time.monotonic() - started  # the call's record is written once its caller has the answer
    after_reply(functools.partial(artifacts.log_tool_call, Path(env["run_dir"]), tool_call, observation, seconds))
    return observation


# ---- evaluation -----------------------------------------------------------------------------
def _evaluation_failed(run_id: str, error: str, code: str) -> None:
    """An evaluation that got going leaves the run ready again, with the reason; one refused
    at once (a run not started, or closed) leaves the run as it was."""
    if store().transition(run_id, ("evaluating",), "ready"):
        store().update_run(run_id, error=error, **failures.fields(code))


@shared_task(name="pool.evaluate", bind=True, **RETRY_OPTIONS)
@_job(on_failure=_evaluation_failed, retry=True)
def evaluate(self, *, host, run_id, job_id):
    """Copying the tests in may be retried; once they have started, never."""
    run = _live_run(run_id)
    container = _client_container(_started_env(run))
    task_dir = _task_dir(run)
    run_path = Path(run["env"]["run_dir"])
    spec = _spec(task_dir)
    if not spec.has_tests:
        raise failures.TaskHasNoTests(f"run {run_id}: the task is a bare Harbor environment: it has no tests")
    store().set_state_if_live(run_id, "evaluating")
    if spec.harbor is not None:
        harbor_verifier.copy_tests(container, task_dir)
    else:
        copy_tests(container, task_dir, spec)
    with committed():
        try:
            if spec.harbor is not None:
                # /logs/verifier is the run's sessions/ folder (environments/harbor_compose.py)
                result = harbor_verifier.run_tests(
                    container, spec, _timeouts(run).eval, run_path / "sessions", settings().harbor_env_allowlist
                )
            else:
                result = run_tests(container, spec, _timeouts(run).eval)
        except Exception as exc:
            if isinstance(exc, failures.Failure) and exc.output:
                artifacts.write_test_output(run_path, exc.output)
            artifacts.write_results(run_path, {"run_id": run_id, "score": None, "tests": {}, **_failed(exc)})
            raise
    artifacts.write_test_output(run_path, result.output)
    outcome = {"score": result.score, "tests": result.tests}
    if result.rewards is not None:
        outcome["rewards"] = result.rewards  # every named reward of a Harbor task
    artifacts.write_results(run_path, {"run_id": run_id, "task_name": run["task_meta"]["task_name"], **outcome})
    store().set_state_if_live(run_id, "evaluated", **outcome, **NO_FAILURE)
    return outcome


# ---- teardown and maintenance ---------------------------------------------------------------
def _teardown_failed(run_id: str, error: str, code: str) -> None:
    through_outage(lambda: store().mark_closed(run_id, error=error), f"run {run_id} closed")


@shared_task(name="pool.close_run", bind=True, **RETRY_OPTIONS)
@_job(on_failure=_teardown_failed, retry=True)
def close_run(self, *, host, run_id, job_id):
    """Teardown is idempotent (containers found by label), so a transient failure is retried.
    Its Redis calls wait out an outage: a teardown cut short by one would leave its run's
    socket folder and its close pending until the reaper sends it again."""
    run = through_outage(lambda: store().get_run(run_id) or {}, f"run {run_id}'s record")
    removed = remove_env(run_id, run.get("env") or {})
    through_outage(lambda: store().mark_closed(run_id), f"run {run_id} closed")
    run_folders.note(host, (run.get("env") or {}).get("run_dir", ""))
    message = f"run {run_id} was closed before this job ran"
    through_outage(lambda: store().fail_queued_jobs(run_id, message), f"run {run_id}'s queued jobs failed")
    return {"containers_removed": removed}
