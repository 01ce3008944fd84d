"""Celery tasks: every operation on a run, carried out on the run's host.

Each task carries the job id of the client's request; `recorded_job` records started/finished in
the state store so the facade (and pollers) see the outcome whatever the queue did, a
failure with its code (poolcore/failures.py), and retries transient Docker failures of the
tasks that can safely run again.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import docker.errors
from celery import chain, shared_task

from environments import artifacts, harbor_verifier, lifecycle, task_builds
from environments.evaluation import copy_tests, run_tests
from environments.session_helper import prepare_container
from environments.tools import run_tool, tool_schemas
from poolcore import disk, failures, priorities
from poolcore.config import settings
from poolcore.harbor_task import is_harbor_folder
from poolcore.state import NO_FAILURE
from poolcore.task_spec import TaskError, Unsupported, load_task_cached
from poolcore.uploaded_tasks import docker_task_name
from tasks import build_quota, image_budget, run_folders, warm_pool
from tasks.job_context import (
    RETRY_OPTIONS,
    HandedOver,
    RunClosed,
    after_reply,
    artifacts_dir,
    client_container,
    committed,
    live_run,
    recorded_job,
    run_task_dir,
    run_timeouts,
    started_env,
)
from tasks.runtime import remove_env, store, subnet_taker, through_outage


def _failed(exc: BaseException) -> dict:
    """A failure's code and text, as a job record and results.json carry them."""
    code = failures.classify(exc)
    return {"error": failures.describe(exc, code), "code": code}


def _start_failed(run_id: str, error: str, code: str) -> None:
    store().set_state_if_live(run_id, "failed", error=error, **failures.fields(code))


def _spec(task_dir: Path):
    try:
        return load_task_cached(task_dir)
    except Unsupported as exc:
        raise failures.TaskUnsupported(str(exc)) from exc
    except TaskError as exc:
        raise failures.TaskInvalid(str(exc)) from exc


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
@recorded_job(on_failure=_start_failed, retry=True)
def ensure_image(self, *, host, run_id, job_id):
    run = live_run(run_id)
    limit = run_timeouts(run).ensure_image
    task_dir = run_task_dir(run)
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
            build_quota.slot(store(), run, job_id, limit),
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
@recorded_job(on_failure=_start_failed, retry=True)
def start_run(self, *, host, run_id, job_id, first_try=True):
    run = live_run(run_id)
    if run.get("env") or self.request.retries:  # a second reset, or a retry of a lost start
        remove_env(run_id, run.get("env") or {})  # replaces the old (or half-made) environment
        store().drop_sessions(run_id)
    meta = run["task_meta"]
    task_dir = run_task_dir(run)
    spec = _spec(task_dir)
    limit = run_timeouts(run).ensure_image
    if first_try and not task_builds.images_current(docker_task_name(meta), task_dir, settings(), limit):
        warm_pool.discard(host, meta["task_path"])  # the task changed since its image was built
        _build_then_start(self.app, host, run_id, meta["task_path"], job_id)
    pooled = settings().warm_pool_size > 0  # off: no claim, no demand noted, no refill job sent
    env = warm_pool.claim(run, host, artifacts_dir) if pooled and first_try else None
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


def _start_cold(run: dict, task_dir: Path, disk_limit: int) -> lifecycle.RunEnv:
    env, container = lifecycle.start(
        run,
        task_dir,
        artifacts_dir(run),
        settings(),
        run_timeouts(run).reset_session,
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
@recorded_job
def exec_tool(self, *, host, run_id, job_id, tool_call, env=None):
    """`env` is the run's environment as the facade read it when it took the call (an
    episode's steps, queued before the start, read the run here): no Redis read per call."""
    given = env is not None
    env = env or started_env(live_run(run_id, call_job=job_id))
    started = time.monotonic()
    try:
        observation = run_tool(
            client_container(env),
            tool_call.get("name"),
            tool_call.get("arguments"),
            _RunSessions(run_id),
            expose_kill=settings().expose_kill_tool,
            ctl_socket=lifecycle.ctl_socket(env) or None,
            workdir=env.get("workdir", ""),
        )
    except Exception:
        if given:  # a run closed since the facade took the call answers that, whatever Docker said
            live_run(run_id)
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
@recorded_job(on_failure=_evaluation_failed, retry=True)
def evaluate(self, *, host, run_id, job_id):
    """Copying the tests in may be retried; once they have started, never."""
    run = live_run(run_id)
    container = client_container(started_env(run))
    task_dir = run_task_dir(run)
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
                    container, spec, run_timeouts(run).eval, run_path / "sessions", settings().harbor_env_allowlist
                )
            else:
                result = run_tests(container, spec, run_timeouts(run).eval)
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
@recorded_job(on_failure=_teardown_failed, retry=True)
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
