"""The command job (app/commands_api.py): one `bash -c` in a run's agent container, on the run
host's exec queue beside its tool calls.

The exec pool runs jobs in threads (tasks/worker.py; EXEC_CONCURRENCY, by default one per live
run the host can hold, up to 128) and takes a message only when a thread is free (no prefetch:
poolcore/queues.py), so a long command holds one thread and no queued tool call waits behind
it; tool calls wait only once a host runs EXEC_CONCURRENCY commands and calls at once. The
thread mostly waits in select() on the exec's connection, so many long commands cost little.
"""

from __future__ import annotations

import logging
import time

from celery import shared_task

from environments import commands
from environments.docker_client import docker_client
from poolcore.config import settings
from poolcore.state import UNAVAILABLE
from tasks.job_context import live_run, recorded_job, started_env
from tasks.runtime import store

CANCEL_CHECK_SECONDS = 0.25  # how often the job's record is read for its client's cancel

log = logging.getLogger(__name__)


class _Watch:
    """commands.run's `stop`: whether the job's client cancelled it (read from Redis at most
    every CANCEL_CHECK_SECONDS). The run needs no touch meanwhile: a run with a job working is
    never idle (RunsState.release_if_idle)."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.next_check = 0.0
        self.cancelled = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self.next_check or self.cancelled:
            return self.cancelled
        self.next_check = now + CANCEL_CHECK_SECONDS
        try:
            self.cancelled = store().cancel_requested(self.job_id)
        except UNAVAILABLE as exc:  # Redis away a moment: the command goes on
            log.warning("command job %s: its cancel mark could not be read: %s", self.job_id, exc)
        return self.cancelled


def command_spec(command: dict, marker: str, max_timeout: float) -> commands.Command:
    """The request's command (app/command_models.py) as the Docker side runs it: its time
    limit, or COMMAND_MAX_TIMEOUT without one."""
    timeout = command.get("timeout_sec")
    return commands.Command(
        command=command["command"],
        marker=marker,
        cwd=command.get("cwd"),
        env=command.get("env"),
        user=command.get("user"),
        timeout_sec=max_timeout if timeout is None else min(float(timeout), max_timeout),
    )


@shared_task(name="pool.run_command", bind=True)
@recorded_job
def run_command(self, *, host, run_id, job_id, command, env=None):
    """`env` is the run's environment as the facade read it (as exec_tool's). Never retried:
    a command may have had effects."""
    given = env is not None
    env = env or started_env(live_run(run_id, call_job=job_id))
    watch = _Watch(job_id)
    if watch():  # cancelled while it was being taken off the queue
        raise commands.Cancelled("cancelled by its client before it started")
    cfg = settings()
    spec = command_spec(command, job_id, cfg.command_max_timeout)
    try:
        return commands.run(docker_client().api, env["client"], spec, cfg.command_output_limit, watch)
    except commands.Cancelled:
        raise
    except Exception:
        if given:  # a run closed meanwhile answers that, whatever Docker said of its container
            live_run(run_id)
        raise
