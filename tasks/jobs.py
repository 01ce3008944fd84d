"""Celery tasks: every operation on a run, carried out on the run's host.

Each task carries the job id of the client's request; `_job` records started/finished in
the state store so the facade (and pollers) see the outcome whatever the queue did.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import docker.errors
import requests.exceptions
from celery import chain, shared_task

from tasks import artifacts, environment, warm_pool
from tasks.runtime import remove_env, store
from tasks.docker_env import docker_client
from tasks.evaluation import EvaluationError, run_tests
from tasks.session_helper import prepare_container
from tasks.shell_tools import run_tool, tool_schemas
from termpool.config import settings
from termpool.paths import resolve_task_path
from termpool.task_spec import load_task



class RunClosed(RuntimeError):
    pass


class HandedOver(Exception):
    """The job was re-queued to other tasks, which will end it."""


def _job(fn=None, *, failed_run_state=None):
    """Record the job's start and end around a task body; the last step of a chain ends it.

    With failed_run_state, a failure also moves the run to that state (a failed start).
    """
    if fn is None:
        return functools.partial(_job, failed_run_state=failed_run_state)

    @functools.wraps(fn)
    def wrapper(self, *, host, run_id, job_id, final=True, **kwargs):
        state = store().job_state(job_id)
        if state in ("succeeded", "failed"):
            return None  # settled already (failed as lost, or its run closed): a late copy of its message
        if state == "queued":
            store().job_started(job_id, self.request.hostname or "")
        store().touch(run_id)  # a run whose job is working is in use, whoever polls it
        try:
            result = fn(self, host=host, run_id=run_id, job_id=job_id, **kwargs)
        except HandedOver:
            return None  # another task carries this job on
        except Exception as exc:
            if failed_run_state:
                store().set_state_if_live(run_id, failed_run_state, error=_describe(exc))
            store().job_finished(job_id, error=_describe(exc), error_code=_error_code(exc))
            raise
        if final:
            store().job_finished(job_id, result=result)
        return result

    return wrapper


def _describe(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if isinstance(exc, (EvaluationError, RunClosed, TimeoutError)) else f"{type(exc).__name__}: {text}"


def _error_code(exc: Exception) -> str:
    """BACKEND_UNAVAILABLE when the Docker engine could not be reached (the facade answers 503)."""
    unreachable = (requests.exceptions.ConnectionError, ConnectionError)
    if isinstance(exc, unreachable) or isinstance(exc.__cause__ or exc.__context__, unreachable):
        return "BACKEND_UNAVAILABLE"
    if isinstance(exc, docker.errors.DockerException) and "Error while fetching server API version" in str(exc):
        return "BACKEND_UNAVAILABLE"
    return ""


def _task_dir(run: dict) -> Path:
    return resolve_task_path(settings().dataset_dir, run["task_meta"]["task_path"])


def _timeouts(run: dict):
    return settings().timeouts.merged(run.get("task_timeouts"))


def _live_run(run_id: str) -> dict:
    run = store().require_run(run_id)
    if run["state"] in ("closing", "closed"):
        raise RunClosed(f"run {run_id} is closed")
    return run


def _client_container(run: dict):
    """The run's client container as a lightweight model: no inspect call per tool call."""
    env = run.get("env")
    if not env or run["state"] in ("allocated", "starting"):
        raise RuntimeError(f"run {run['run_id']} has not been reset")
    return docker_client().containers.prepare_model({"Id": env["client"], "Config": {"User": env.get("user", "")}})


class _RunSessions:
    """Shell-session bookkeeping of one run, kept in Redis so any worker can continue it."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def get(self, sid: str) -> dict:
        return store().session(self.run_id, sid)

    def set(self, sid: str, **fields) -> None:
        store().update_session(self.run_id, sid, **fields)


# ---- reset ----------------------------------------------------------------------------------
@shared_task(name="pool.ensure_image", bind=True)
@_job(failed_run_state="failed")
def ensure_image(self, *, host, run_id, job_id):
    run = _live_run(run_id)
    timeouts = _timeouts(run)
    image = environment.ensure_image(run["task_meta"]["task_name"], _task_dir(run), settings(),
                                     timeouts.ensure_image, store().r)
    store().mark_image_ready(host, run["task_meta"]["task_path"])
    return image


@shared_task(name="pool.start_run", bind=True)
@_job(failed_run_state="failed")
def start_run(self, *, host, run_id, job_id, first_try=True):
    run = _live_run(run_id)
    if run.get("env") or self.request.retries:  # a second reset, or a retry of a lost start
        remove_env(run_id, run.get("env") or {})  # replaces the old (or half-made) environment
        store().drop_sessions(run_id)
    meta = run["task_meta"]
    task_dir = _task_dir(run)
    spec = load_task(task_dir)
    warm = environment.warm_capable(task_dir, settings())
    env = warm_pool.claim(run, host, _run_path) if warm else None
    if env is None:
        try:
            env = _start_cold(run, task_dir)
        except docker.errors.ImageNotFound:
            if not first_try:
                raise
            # The image was removed since it was built: build it again, then start.
            store().mark_image_ready(host, meta["task_path"], False)
            chain(self.app.signature("pool.ensure_image", kwargs=dict(host=host, run_id=run_id, job_id=job_id,
                                                                       final=False), immutable=True),
                  self.app.signature("pool.start_run", kwargs=dict(host=host, run_id=run_id, job_id=job_id,
                                                                    first_try=False), immutable=True)).apply_async()
            raise HandedOver() from None
    if warm:
        self.app.send_task("pool.refill_warm", kwargs={"host": host, "task_path": meta["task_path"],
                                                       "task_name": meta["task_name"]})
    instruction = meta.get("instruction") or spec.instruction
    reply = {"user_msg": f"Task name:{meta['task_name']}\nTask instruction: {instruction}",
             "tool_schemas": tool_schemas(settings().expose_kill_tool)}
    if not store().set_state_if_live(run_id, "ready", env=env.to_dict(), error="", score=None, tests=None, **reply):
        remove_env(run_id, env.to_dict())  # closed while starting
        raise RunClosed(f"run {run_id} was closed while it was starting")
    return reply


def _run_path(run: dict, mounts_from: Path | None = None) -> Path:
    ctx = run.get("run_ctx") or {}
    log_dir = ctx.get("log_dir") or str(settings().default_log_dir)
    return artifacts.run_dir(log_dir, run["task_meta"]["task_name"], str(ctx.get("uid", "0")), run["run_id"],
                             mounts_from)


def _start_cold(run: dict, task_dir: Path) -> environment.RunEnv:
    env, container = environment.start(run, task_dir, _run_path(run), settings(), _timeouts(run).reset_session)
    try:
        prepare_container(container, serve=bool(env.ctl_dir))
    except BaseException:
        remove_env(run["run_id"], env.to_dict())
        raise
    return env


@shared_task(name="pool.exec_tool", bind=True)
@_job
def exec_tool(self, *, host, run_id, job_id, tool_call):
    run = _live_run(run_id)
    container = _client_container(run)
    started = time.monotonic()
    store().transition(run_id, ("ready", "evaluated"), "busy")
    try:
        observation = run_tool(container, tool_call.get("name"), tool_call.get("arguments"), _RunSessions(run_id),
                               expose_kill=settings().expose_kill_tool,
                               ctl_socket=environment.ctl_socket(run["env"]) or None)
    finally:
        store().transition(run_id, ("busy",), "ready")
    artifacts.log_tool_call(Path(run["env"]["run_dir"]), tool_call, observation, time.monotonic() - started)
    return observation


# ---- evaluation -----------------------------------------------------------------------------
@shared_task(name="pool.evaluate", bind=True)
@_job
def evaluate(self, *, host, run_id, job_id):
    run = _live_run(run_id)
    container = _client_container(run)
    task_dir = _task_dir(run)
    run_path = Path(run["env"]["run_dir"])
    store().set_state_if_live(run_id, "evaluating")
    try:
        result = run_tests(container, task_dir, load_task(task_dir), _timeouts(run).eval)
    except Exception as exc:
        if isinstance(exc, EvaluationError):
            artifacts.write_test_output(run_path, exc.output)
        artifacts.write_results(run_path, {"run_id": run_id, "score": None, "tests": {}, "error": _describe(exc)})
        store().set_state_if_live(run_id, "ready", error=_describe(exc))
        raise
    artifacts.write_test_output(run_path, result.output)
    artifacts.write_results(run_path, {"run_id": run_id, "task_name": run["task_meta"]["task_name"],
                                       "score": result.score, "tests": result.tests})
    store().set_state_if_live(run_id, "evaluated", score=result.score, tests=result.tests, error="")
    return {"score": result.score, "tests": result.tests}


# ---- teardown and maintenance ---------------------------------------------------------------
@shared_task(name="pool.close_run", bind=True)
@_job
def close_run(self, *, host, run_id, job_id):
    run = store().get_run(run_id) or {}
    try:
        removed = remove_env(run_id, run.get("env") or {})
    except Exception as exc:
        store().mark_closed(run_id, error=_describe(exc))
        raise
    store().mark_closed(run_id)
    store().fail_queued_jobs(run_id, f"run {run_id} was closed before this job ran")
    return {"containers_removed": removed}


