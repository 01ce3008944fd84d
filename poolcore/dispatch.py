"""Enqueueing jobs: record the job, then send its Celery task to the run's host.

Used by the facade (both HTTP faces) and by the reaper; imports nothing Docker-side, so the
facade can send work without loading the worker code. Every job of a run is sent with the run's
priority class (`priority`: poolcore/priorities.py), so its host's workers take it before the
waiting jobs of lower classes; a chain's steps carry it in their own options.
"""

from __future__ import annotations

import json
import uuid

from celery import Celery, chain

from poolcore import failures, priorities
from poolcore.state import Store

REPR_LIMIT = 200  # Flower shows arguments; file contents and scripts are cut to this
CALL_FIELD_LIMIT = 4096  # characters of a tool call's name and of each argument kept in its job record


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= REPR_LIMIT else text[:REPR_LIMIT] + f"... ({len(text)} chars)"


# Left out of what Flower shows: the host is the queue's name, the job id is the task's id, and
# a tool call's env is the run's (Flower parses every event's arguments: shorter is cheaper).
HIDDEN_KWARGS = ("host", "job_id", "env")


def _kwargs_repr(kwargs: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {_short(v)}" for k, v in kwargs.items() if k not in HIDDEN_KWARGS) + "}"


def job_signature(celery: Celery, name: str, shown: dict | None = None, priority: str | None = None, **kwargs):
    """`shown`: what Flower shows of kwargs in their place (nothing secret); `priority`: the
    run's class (None: the default one)."""
    return celery.signature(
        name,
        kwargs=kwargs,
        immutable=True,
        kwargsrepr=_kwargs_repr({**kwargs, **(shown or {})}),
        priority=priorities.level(priority),
    )


def new_job_id() -> str:
    return str(uuid.uuid4())


def new_job(store: Store, run_id: str, kind: str, **extra) -> str:
    job_id = new_job_id()
    store.create_job(job_id, run_id, kind, **extra)
    return job_id


def recorded_call(tool_call: dict) -> dict:
    """The tool call as its job record keeps it, for the run viewer's transcript: the name and
    each argument (non-strings as JSON) cut to CALL_FIELD_LIMIT characters."""

    def short(value):
        if isinstance(value, (bool, int, float)) or value is None:
            return value
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return failures.cap(text, CALL_FIELD_LIMIT) if len(text) > CALL_FIELD_LIMIT else value

    arguments = tool_call.get("arguments") or {}
    return {
        "name": failures.cap(str(tool_call.get("name")), CALL_FIELD_LIMIT),
        "arguments": {failures.cap(str(key), CALL_FIELD_LIMIT): short(value) for key, value in arguments.items()},
    }


def start_steps(
    celery: Celery, store: Store, run_id: str, host: str, job_id: str, task_path: str, priority: str | None = None
) -> list:
    """Make sure the task's images exist (build queue), then start the run (lifecycle). Once
    this host has built the task's images the build step is skipped: one queue hop less."""
    ids = dict(host=host, run_id=run_id, job_id=job_id, priority=priority)
    start = job_signature(celery, "pool.start_run", **ids).set(task_id=job_id)
    if store.image_ready(host, task_path):
        return [start]
    return [job_signature(celery, "pool.ensure_image", final=False, **ids).set(task_id=f"{job_id}.image"), start]


def enqueue_start(
    celery: Celery, store: Store, run_id: str, host: str, task_path: str, priority: str | None = None
) -> str:
    """Reset: images, then the run's services; one job for the client."""
    job_id = new_job(store, run_id, "start")
    chain(*start_steps(celery, store, run_id, host, job_id, task_path, priority), app=celery).apply_async()
    return job_id


def enqueue(
    celery: Celery, store: Store, kind: str, task: str, run_id: str, host: str, job_fields: dict | None = None, **kwargs
) -> str:
    return send_job(celery, store, new_job_id(), kind, task, run_id, host, job_fields, **kwargs)


def send_job(
    celery: Celery,
    store: Store,
    job_id: str,
    kind: str,
    task: str,
    run_id: str,
    host: str,
    job_fields: dict | None = None,
    **kwargs,
) -> str:
    """Record and send a job whose id the caller chose (an archive job keys its blob by it);
    `priority` among kwargs is the run's class."""
    store.create_job(job_id, run_id, kind, **(job_fields or {}))
    return send_recorded(celery, store, job_id, task, run_id, host, **kwargs)


def send_recorded(celery: Celery, store: Store, job_id: str, task: str, run_id: str, host: str, **kwargs) -> str:
    """Send a job whose record is written already; taken back if it could not be sent."""
    try:
        job_signature(celery, task, host=host, run_id=run_id, job_id=job_id, **kwargs).apply_async(task_id=job_id)
    except BaseException:
        store.discard_job(job_id, run_id)  # never sent: no job left queued for nothing
        raise
    return job_id


def send_tool_call(celery: Celery, *, tool_call: dict, env: dict | None = None, priority: str | None = None, **ids):
    """Send a tool call whose job is recorded already (Store.use_run); `ids`: its host, run_id
    and job_id. With `env` (the run's environment as the caller read it) its worker reads
    nothing of the run."""
    kwargs = {"tool_call": tool_call, **({"env": env} if env else {})}
    job_signature(celery, "pool.exec_tool", None, priority, **ids, **kwargs).apply_async(task_id=ids["job_id"])


def recorded_command(command: dict) -> dict:
    """A command as its job record keeps it (the run viewer shows it): its text cut to
    CALL_FIELD_LIMIT characters, the names of its env variables (values may be secrets)."""
    return {
        "command": failures.cap(command["command"], CALL_FIELD_LIMIT),
        "cwd": command.get("cwd"),
        "user": command.get("user"),
        "timeout_sec": command.get("timeout_sec"),
        "env": sorted(command.get("env") or {}),
    }


def send_command(celery: Celery, *, command: dict, env: dict | None = None, priority: str | None = None, **ids):
    """Send a command whose job is recorded already (Store.use_run), as send_tool_call does."""
    kwargs = {"command": command, **({"env": env} if env else {})}
    shown = {"command": recorded_command(command)}  # env values may be secrets (API keys): names only
    job_signature(celery, "pool.run_command", shown, priority, **ids, **kwargs).apply_async(task_id=ids["job_id"])


def enqueue_evaluation(
    celery: Celery, store: Store, run_id: str, host: str, job_id: str = "", priority: str | None = None
) -> str:
    job_id = job_id or new_job_id()
    return send_job(celery, store, job_id, "evaluation", "pool.evaluate", run_id, host, priority=priority)


def enqueue_fork(
    celery: Celery, store: Store, run_id: str, host: str, job_id: str, children: list, priority: str | None = None
) -> str:
    """The fork job of children already placed (Store.place_fork), on the source's host."""
    store.create_job(job_id, run_id, "fork", children=children)
    ids = dict(host=host, run_id=run_id, job_id=job_id)
    job_signature(celery, "pool.fork_run", priority=priority, children=children, **ids).apply_async(task_id=job_id)
    return job_id


def enqueue_close(celery: Celery, store: Store, run_id: str, host: str) -> str:
    """The run's teardown, at its class (read here: the reaper and /close know only the id)."""
    return enqueue(celery, store, "close", CLOSE_TASK, run_id, host, priority=store.run_priority(run_id))


def release_and_close(celery: Celery, store: Store, run_id: str) -> str | None:
    """Release a live run and queue its teardown at the run's class, its job recorded in the
    release's own round trip (what a close costs the caller); None when nothing was live. A
    lost run's teardown waits in its host's queue."""
    job_id = new_job_id()
    host, priority = store.release_for_close(run_id, store.job_fields(job_id, run_id, "close"))
    if host is None:
        return None
    return send_recorded(celery, store, job_id, CLOSE_TASK, run_id, host, priority=priority)


CLOSE_TASK = "pool.close_run"


# ---- one-shot episodes ------------------------------------------------------------------------
EPISODE_FAILED_TASK = "pool.episode_failed"
RELEASE_TASK = "pool.release_run"


def close_signature(celery: Celery, run_id: str, host: str, job_id: str, priority: str | None = None):
    """The teardown step of an existing close job (also used by the episode's error callback)."""
    ids = dict(host=host, run_id=run_id, job_id=job_id)
    return job_signature(celery, CLOSE_TASK, priority=priority, **ids).set(task_id=job_id)


def _episode_jobs(store: Store, run_id: str, start_job: str, script: list, evaluate: bool, close: bool) -> dict:
    """Create every step's job record up front, so the whole episode is visible before it runs."""
    store.create_job(start_job, run_id, "start")
    return {
        "start": start_job,
        "tool_calls": [new_job(store, run_id, "tool_call", call=recorded_call(call)) for call in script],
        "evaluation": new_job(store, run_id, "evaluation") if evaluate else None,
        "close": new_job(store, run_id, "close") if close else None,
    }


def _episode_steps(
    celery: Celery, store: Store, run_id: str, host: str, jobs: dict, script: list, task_path: str, priority: str | None
) -> list:
    ids = dict(host=host, run_id=run_id, priority=priority)
    start = jobs["start"]
    steps = start_steps(celery, store, run_id, host, start, task_path, priority)
    for job_id, call in zip(jobs["tool_calls"], script):
        steps.append(job_signature(celery, "pool.exec_tool", job_id=job_id, tool_call=call, **ids).set(task_id=job_id))
    if jobs["evaluation"]:
        evaluation = jobs["evaluation"]
        steps.append(job_signature(celery, "pool.evaluate", job_id=evaluation, **ids).set(task_id=evaluation))
    if jobs["close"]:
        # The capacity slot is freed by a release step that opens the close job, as /close does.
        close = jobs["close"]
        steps.append(
            job_signature(celery, RELEASE_TASK, final=False, job_id=close, **ids).set(task_id=f"{close}.release")
        )
        steps.append(close_signature(celery, run_id, host, close, priority))
    return steps


def enqueue_episode(
    celery: Celery,
    store: Store,
    run_id: str,
    host: str,
    start_job: str,
    task_path: str,
    script: list,
    evaluate: bool = False,
    close: bool = False,
    priority: str | None = None,
) -> dict:
    """A whole episode as one Celery chain: start, the script's tool calls, evaluation, close.

    Every step has its own job record. A failing step stops the chain; the error callback
    (tasks/episode.py) then fails the steps that will never run and, if close was asked for,
    tears the run down, so nothing is left queued or running. Returns the job ids by step.

    Cost: each step's message carries the rest of the chain (about 1 KB a step plus the tool
    call's arguments), so n steps move O(n^2) bytes through Redis; the runs API caps n.
    """
    jobs = _episode_jobs(store, run_id, start_job, script, evaluate, close)
    order = [jobs["start"], *jobs["tool_calls"], *[j for j in (jobs["evaluation"], jobs["close"]) if j]]
    store.set_episode_jobs(start_job, order)
    steps = _episode_steps(celery, store, run_id, host, jobs, script, task_path, priority)
    # Every step's message carries the rest of the chain, each step with this callback: keep it small.
    on_error = celery.signature(
        EPISODE_FAILED_TASK,
        immutable=True,
        kwargs=dict(host=host, run_id=run_id, start_job=start_job, close_job=jobs["close"] or ""),
        priority=priorities.level(priority),
    )
    workflow = chain(*steps, app=celery)
    workflow.link_error(on_error)
    workflow.apply_async()
    return jobs
