"""Enqueueing jobs: record the job, then send its Celery task to the run's host.

Used by the facade (both HTTP faces) and by the reaper; imports nothing Docker-side, so the
facade can send work without loading the worker code.
"""
from __future__ import annotations

import uuid

from celery import Celery

from termpool.state import Store

REPR_LIMIT = 200  # Flower shows arguments; file contents and scripts are cut to this


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= REPR_LIMIT else text[:REPR_LIMIT] + f"... ({len(text)} chars)"


def _kwargs_repr(kwargs: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {_short(v)}" for k, v in kwargs.items()) + "}"


def _signature(celery: Celery, name: str, **kwargs):
    return celery.signature(name, kwargs=kwargs, immutable=True, kwargsrepr=_kwargs_repr(kwargs))


def new_job(store: Store, run_id: str, kind: str) -> str:
    job_id = str(uuid.uuid4())
    store.create_job(job_id, run_id, kind)
    return job_id


def enqueue_start(celery: Celery, store: Store, run_id: str, host: str) -> str:
    """Reset: make sure the task's images exist (build queue), then start the run (lifecycle)."""
    job_id = new_job(store, run_id, "start")
    ids = dict(host=host, run_id=run_id, job_id=job_id)
    workflow = (_signature(celery, "pool.ensure_image", final=False, **ids).set(task_id=f"{job_id}.image")
                | _signature(celery, "pool.start_run", **ids).set(task_id=job_id))
    workflow.apply_async()
    return job_id


def enqueue(celery: Celery, store: Store, kind: str, task: str, run_id: str, host: str, **kwargs) -> str:
    job_id = new_job(store, run_id, kind)
    _signature(celery, task, host=host, run_id=run_id, job_id=job_id, **kwargs).apply_async(task_id=job_id)
    return job_id


def enqueue_tool_call(celery: Celery, store: Store, run_id: str, host: str, tool_call: dict) -> str:
    return enqueue(celery, store, "tool_call", "pool.exec_tool", run_id, host, tool_call=tool_call)


def enqueue_evaluation(celery: Celery, store: Store, run_id: str, host: str) -> str:
    return enqueue(celery, store, "evaluation", "pool.evaluate", run_id, host)


def enqueue_close(celery: Celery, store: Store, run_id: str, host: str) -> str:
    return enqueue(celery, store, "close", "pool.close_run", run_id, host)
