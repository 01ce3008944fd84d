"""The protocol, written once for both drivers (drivers.py): each operation of a job, a run or a
lease is a generator that says what I/O it needs and is sent the outcome, so it does no I/O
itself (protocol.py: the request machinery; pool_ops.py: the pool's own operations and its
retry policy; commands.py and archives.py: operations mixed into a run's)."""

from __future__ import annotations

import uuid

from termpool.client.archives import ArchiveOps
from termpool.client.calls import Evaluation, exec_call, task_meta, tool_call, write_file_call
from termpool.client.commands import CommandOps
from termpool.client.errors import TermpoolError
from termpool.client.protocol import Op, Operations, queuing, request_op, start_options, wait_job


class JobOps(Operations):
    def __init__(self, pool, job_id: str):
        self._pool = pool
        self.id = job_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def wait(self, timeout: float | None = None) -> Op:
        """The job's result once it has succeeded (observation text, {score, tests}, ...);
        raises its typed error when it failed, WaitTimeout after `timeout` (default: the
        pool's job_timeout)."""
        job = yield from wait_job(self._pool, self.id, self._pool.job_timeout if timeout is None else timeout)
        return job.get("result")

    def record(self) -> Op:
        """The job's record as it is now: state, result, error, code, retryable, times."""
        return (yield from self._call("GET", f"/v1/jobs/{self.id}", idempotent=True))["job"]


class SessionOps(Operations):
    """The tools of one task environment, whichever face carries them (`_tool`)."""

    id: str

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def _tool(self, call: dict) -> Op:
        """Run one tool call (tool_call's dict); its observation text."""
        raise NotImplementedError

    def _close(self) -> Op:
        """The close operation (not the driver's method of the same name, which wraps it)."""
        raise NotImplementedError

    def _exit(self, exc_type, exc, tb) -> Op:
        """Leaving a `with` (`async with`) block: close. Returns None, so the block's own
        error goes on."""
        try:
            yield from self._close()
        except TermpoolError:
            if exc_type is None:  # never hide the error that ended the block
                raise

    def tool(self, name: str, **arguments) -> Op:
        """Run any tool call and return its observation text."""
        return (yield from self._tool(tool_call(name, **arguments)))

    def exec(self, command: str, *, id: str = "main", block: bool | None = True, timeout: float | None = 20.0) -> Op:
        """shell_exec: the command's output (blocking), or the session-started text (block=False)."""
        return (yield from self._tool(exec_call(command, id=id, block=block, timeout=timeout)))

    def view(self, id: str = "main") -> Op:
        """shell_view: the output of session `id` since the last view."""
        return (yield from self._tool(tool_call("shell_view", id=id)))

    def write_to_process(self, id: str, text: str) -> Op:
        """shell_write_to_process: send `text` and a newline to session `id`; what it printed."""
        return (yield from self._tool(tool_call("shell_write_to_process", id=id, command=text)))

    def write_file(self, path: str, content: str) -> Op:
        """shell_write_content_to_file: write `content` to `path` in the task container."""
        return (yield from self._tool(write_file_call(path, content)))


class RunOps(ArchiveOps, SessionOps, CommandOps):
    def __init__(self, pool, run_id: str, start_job: str | None = None, start: dict | None = None):
        self._pool = pool
        self.id = run_id
        self.start_job = start_job
        start = start or {}
        self.user_msg: str | None = start.get("user_msg")  # the task's prompt, once started
        self.tool_schemas: list | None = start.get("tool_schemas")  # the four tools' schemas

    def _submit(self, call: dict) -> Op:
        reply = yield from request_op(self._pool, queuing("POST", f"/v1/runs/{self.id}/tool_calls", call))
        return self._pool._job_class(self._pool, reply["job_id"])

    def submit(self, name: str, **arguments) -> Op:
        """Submit any tool call without waiting: its Job (call .wait() for the observation)."""
        return (yield from self._submit(tool_call(name, **arguments)))

    def _tool(self, call: dict) -> Op:
        job = yield from self._submit(call)
        return (yield from wait_job(self._pool, job.id, self._pool.job_timeout))["result"]

    def evaluate(self) -> Op:
        """Run the task's tests: an Evaluation (score, per-test results)."""
        reply = yield from request_op(self._pool, queuing("POST", f"/v1/runs/{self.id}/evaluation"))
        result = (yield from wait_job(self._pool, reply["job_id"], self._pool.job_timeout))["result"] or {}
        return Evaluation(
            score=float(result.get("score") or 0.0),
            tests=result.get("tests") or {},
            rewards=result.get("rewards") or {},
        )

    def wait_ready(self) -> Op:
        """Wait for the start job (after Pool.start(wait=False)); raises its error if it failed."""
        result = (yield from wait_job(self._pool, self.start_job, self._pool.job_timeout))["result"] or {}
        self.user_msg, self.tool_schemas = result.get("user_msg"), result.get("tool_schemas")
        return self

    def fork(self, count: int = 1, wait: bool = True) -> Op:
        """`count` new runs on this run's host whose services start from its files as they are
        now (POST /v1/runs/<id>/fork); this run goes on unchanged. Returns the children (Runs to
        close like any other), ready unless wait=False (then wait_ready() each)."""
        reply = yield from request_op(self._pool, queuing("POST", f"/v1/runs/{self.id}/fork", {"count": count}))
        if wait:
            yield from wait_job(self._pool, reply["job_id"], self._pool.job_timeout)
        start = {"user_msg": self.user_msg, "tool_schemas": self.tool_schemas}
        return [self._pool._run_class(self._pool, run_id, reply["job_id"], start) for run_id in reply["run_ids"]]

    def info(self) -> Op:
        """The run record: state, host, score, tests, error, code, job ids, ..."""
        return (yield from self._call("GET", f"/v1/runs/{self.id}", idempotent=True))["run"]

    def close(self, wait: bool = False) -> Op:
        """Release the run (its capacity slot frees at once) and queue its teardown; with
        wait=True, return only once its containers are gone. Closing twice is harmless."""
        reply = yield from self._call("DELETE", f"/v1/runs/{self.id}", idempotent=True)
        if wait and reply.get("job_id"):
            yield from wait_job(self._pool, reply["job_id"], self._pool.job_timeout, raise_failed=False)

    _close = close


class LeaseOps(SessionOps):
    """One lease of the blocking pool API: each call is one request that returns when its job
    is done (so its reply may take up to the pool's job_timeout, a reset with a build)."""

    def __init__(self, pool, lease_id: str, reused: bool = False):
        self._pool = pool
        self.id = lease_id
        self.reused = reused  # /allocate gave back the lease of the same request_id
        self.user_msg: str | None = None  # the task's prompt, once reset
        self.tool_schemas: list | None = None

    def _post(self, path: str, fields: dict | None = None, idempotent: bool = False, key: str | None = None) -> Op:
        body = {"lease_id": self.id, **(fields or {})}
        options = dict(idempotent=idempotent, long_poll=self._pool.job_timeout, key=key)
        return (yield from self._call("POST", path, body=body, **options))

    def reset(
        self,
        task: str,
        *,
        task_path: str | None = None,
        instruction: str | None = None,
        run_ctx: dict | None = None,
        task_timeouts: dict | None = None,
    ) -> Op:
        """(Re)start the lease's environment for `task` (POST /reset; a second reset replaces
        the first environment); the lease, with user_msg and tool_schemas set."""
        fields = {"task_meta": task_meta(task, task_path, instruction), **start_options(run_ctx, task_timeouts)}
        reply = yield from self._post("/reset", fields)
        self.user_msg, self.tool_schemas = reply.get("user_msg"), reply.get("tool_schemas")
        return self

    def _tool(self, call: dict) -> Op:
        # Its own Idempotency-Key: sent again after a lost reply, it waits for the same call.
        return (yield from self._post("/exec_tool", {"tool_call": call}, key=uuid.uuid4().hex))["observation"]

    def evaluate(self) -> Op:
        """Run the task's tests (POST /evaluate): an Evaluation (tests: {} when the reply has none)."""
        reply = yield from self._post("/evaluate")
        return Evaluation(score=float(reply.get("score") or 0.0), tests=reply.get("tests") or {})

    def fork(self, count: int = 1) -> Op:
        """`count` new leases, reset already, started from this lease's files (POST /fork)."""
        reply = yield from self._post("/fork", {"count": count})
        children = [self._pool._lease_class(self._pool, lease_id) for lease_id in reply["lease_ids"]]
        for child in children:
            child.user_msg, child.tool_schemas = self.user_msg, self.tool_schemas
        return children

    def heartbeat(self) -> Op:
        """Mark the lease as used, so the idle reaper leaves it (POST /heartbeat)."""
        yield from self._post("/heartbeat", idempotent=True)

    def close(self) -> Op:
        """Release the lease and queue its teardown (POST /close); whether it was still live
        (False when unknown or closed before: closing twice is harmless)."""
        return (yield from self._post("/close", idempotent=True)).get("found") is True

    _close = close
