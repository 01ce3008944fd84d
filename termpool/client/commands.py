"""Commands on a run (POST /v1/runs/<id>/commands): Harbor's `exec(command, cwd, env,
timeout_sec, user)`, its stdout and stderr apart, a non-zero exit status as a result.

`Run.command` / `AsyncRun.command` (the mixin below, sans-IO like ops.py) wait for the job.
A caller that abandons the wait (an asyncio task cancelled, say by a timeout; Ctrl-C in the
blocking client), or a wait past the pool's job_timeout, cancels the job (DELETE
/v1/jobs/<id>), so the service kills everything the command started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from termpool.client.errors import TermpoolError, WaitTimeout
from termpool.client.protocol import Call, OnCancel, Op, queuing, request_op, wait_job

WAIT_MARGIN = 60.0  # on top of a command's timeout_sec, for its queueing and its kill


@dataclass(frozen=True)
class CommandResult:
    """What a command did: its exit status (124 when timeout_sec passed), stdout and stderr
    (UTF-8, undecodable bytes replaced), whether either was cut at the service's
    COMMAND_OUTPUT_LIMIT, and whether it timed out."""

    return_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False

    @classmethod
    def from_job(cls, result: dict) -> CommandResult:
        return cls(**{field.name: result[field.name] for field in dataclasses.fields(cls) if field.name in result})


class CommandOps:
    """Mixed into RunOps (ops.py), whose `id`, `_pool` and `_call` it uses."""

    def command(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
        timeout_sec: float | None = None,
    ) -> Op:
        """Run `command` with `bash -c` in the run's agent container: a CommandResult once it
        has ended, whatever its exit status. cwd (absolute), env (over the container's), user
        (a name or uid) and timeout_sec default to the container's own and the service's
        COMMAND_MAX_TIMEOUT. Raises UnknownUser for a user the container lacks, BadRequest
        for bad input; abandoning the call cancels the command (module docstring)."""
        body = {"command": command, "cwd": cwd, "env": env, "user": user, "timeout_sec": timeout_sec}
        reply = yield from request_op(self._pool, queuing("POST", f"/v1/runs/{self.id}/commands", body))
        cancel = Call("DELETE", f"/v1/jobs/{reply['job_id']}", idempotent=True)
        yield OnCancel(cancel)
        try:
            job = yield from wait_job(self._pool, reply["job_id"], self._command_wait(timeout_sec))
        except WaitTimeout:
            yield from _cancel_quietly(self._pool, cancel)
            raise
        yield OnCancel(None)
        return CommandResult.from_job(job["result"])

    def _command_wait(self, timeout_sec: float | None) -> float | None:
        """How long to wait for a command: the pool's job_timeout, or longer for a longer limit."""
        limit = self._pool.job_timeout
        if limit is None or timeout_sec is None:
            return limit
        return max(limit, timeout_sec + WAIT_MARGIN)


def _cancel_quietly(pool, cancel) -> Op:
    try:
        yield from request_op(pool, cancel)
    except TermpoolError:
        pass  # the job may have ended meanwhile, or the service be away: the wait's error is the one raised
