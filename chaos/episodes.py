"""Episodes through the blocking pool API, the way a router drives them, with every request
timed and every failure recorded by its code.

One episode: allocate, reset, three tool calls (an echo, a blocking `sleep 2`, a pwd), write
the solution file, evaluate (must score 1.0), close. A failed tool call is what an agent sees
as an error observation: it is counted as a lost tool call and the episode goes on. The other
steps are idempotent (a reset replaces the environment, the write writes the same bytes, an
evaluation runs the tests again, a close is a no-op the second time), so, as a router that
honours `retryable` does, a step answered with a retryable failure is sent again while
keep_trying allows; a step that still fails ends the episode (its lease is closed, best
effort) and its run counts as lost.

With the seed's client instead (`--client seed`), every failed call is sent again a fixed number
of times whatever its code, as the seed's env_client does over slime's HTTP helper (SEED_RETRIES),
tool calls included. Either way an episode is *whole* when it scored, closed and lost no tool
call, and *whole without retries* when it also sent no request twice: the figure a client that
never retries would have seen.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from termpool.client import Pool, ServiceUnreachable, TermpoolError, exec_call, write_file_call

SOLUTION = write_file_call("/app/hello.txt", "Hello, world!\n")
TOOL_CALLS = (  # (tool call, what its observation must contain)
    (exec_call("echo chaos-hi", id="a", timeout=20), "chaos-hi"),
    (exec_call("sleep 2; echo slept", id="a", timeout=20), "slept"),
    (exec_call("pwd", id="b", timeout=20), "/"),
)


class StepFailed(Exception):
    def __init__(self, step: str, code: str, detail: str, retryable: bool = False):
        super().__init__(f"{step}: {code}: {detail}")
        self.step, self.code, self.detail, self.retryable = step, code, detail, retryable


@dataclass
class Log:
    """Every request of a scenario's episodes (thread-safe): durations and failures."""

    requests: list = field(default_factory=list)  # (step, seconds, ok)
    # Every failed request, retried ones and tool calls too: (when it ended, monotonic; step;
    # code; its message), so a scenario can count what failed after its fault ended.
    failures: list = field(default_factory=list)
    episodes: list = field(default_factory=list)  # {"ok", "step", "code", "detail", "lost_tool_calls"}
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, step: str, seconds: float, ok: bool, code: str = "", detail: str = "") -> None:
        with self.lock:
            self.requests.append((step, round(seconds, 3), ok))
            if not ok:
                self.failures.append((time.monotonic(), step, code, detail))

    def episode(self, record: dict) -> None:
        with self.lock:
            self.episodes.append(record)


def failure_code(error: TermpoolError) -> str:
    """The reply's `code` when it has one, else `HTTP <status>`, or, with no reply at all, the
    HTTP client's error (ConnectError, ReadTimeout, ...)."""
    if isinstance(error, ServiceUnreachable):
        return type(error.__cause__).__name__
    if isinstance(error.reply, dict) and error.reply.get("code"):
        return str(error.reply["code"])
    return f"HTTP {error.status}"


class Client:
    """The pool API through termpool.client, without its retries (Retrying decides); every
    request is timed into the log. One request is bounded by `timeout` in all."""

    def __init__(self, url: str, log: Log | None, timeout: float):
        self.log = log
        self.pool = Pool(url, timeout=timeout, job_timeout=0, retries=0)

    def call(self, step: str, request):
        """request(): one pool-API call through the client (a Lease method, Pool.allocate);
        its result, or StepFailed."""
        start = time.monotonic()
        try:
            result = request()
        except TermpoolError as error:
            failed = StepFailed(step, failure_code(error), error.message[:200], error.retryable)
            self._log(step, start, False, failed.code, failed.detail)
            raise failed from error
        self._log(step, start, True)
        return result

    def _log(self, step: str, start: float, ok: bool, code: str = "", detail: str = "") -> None:
        if self.log is not None:
            self.log.request(step, time.monotonic() - start, ok, code, detail)

    def close(self) -> None:
        self.pool.close()


# The seed's client: how often it sends a failed call again (any failure: it does not read
# `retryable`), SEED_RETRY_WAIT seconds apart. A close is not sent again.
SEED_RETRIES = {"allocate": 100, "reset": 10, "tool_call": 3, "write": 3, "evaluate": 1}
SEED_RETRY_WAIT = 2.0


class SeedRetrying:
    """Sends a failed call again SEED_RETRIES[step] times, whatever the failure."""

    def __init__(self, client: Client):
        self.client, self.retries = client, 0

    def call(self, step: str, request):
        left = SEED_RETRIES.get(step, 0)
        while True:
            try:
                return self.client.call(step, request)
            except StepFailed:
                if left <= 0:
                    raise
            left -= 1
            self.retries += 1
            time.sleep(SEED_RETRY_WAIT)


# Retryable, but not by sending the step again: the run itself is gone (a router starts a new one).
RUN_GONE = ("CONTAINER_LOST", "HOST_LOST")


class Retrying:
    """Sends an idempotent step again while its failure is retryable and keep_trying(seconds
    since the step's first failure) says so; counts the retries. No reply at all (connection
    refused or reset while the stack restarts) is retryable too (ServiceUnreachable), as a
    router resends to a facade that is coming back. A run that is gone (RUN_GONE) is not
    asked again: the episode ends there."""

    def __init__(self, client: Client, keep_trying):
        self.client, self.keep_trying, self.retries = client, keep_trying, 0

    def call(self, step: str, request):
        first = None
        while True:
            try:
                return self.client.call(step, request)
            except StepFailed as failed:
                first = first or time.monotonic()
                if not failed.retryable or failed.code in RUN_GONE or not self.keep_trying(time.monotonic() - first):
                    raise
            self.retries += 1
            time.sleep(1)


def episode(
    client: Client, task_key: str, task_name: str, tool_calls=TOOL_CALLS, keep_trying=None, seed: bool = False
) -> dict:
    """One episode; returns its record (never raises). An episode that never gets a lease was
    refused; one whose step fails for good after it got its lease is a lost run. Allocate (same
    request id) and the idempotent steps are retried while retryable; tool calls never are.
    seed: retry as the seed's client does instead (SeedRetrying), tool calls too."""
    lease, lost = None, 0
    steps = SeedRetrying(client) if seed else Retrying(client, keep_trying or (lambda waited: False))
    tools = steps if seed else client
    allocate_retries = 0
    try:
        request_id = uuid.uuid4().hex  # the same for every try: a repeat gets the same lease
        lease = steps.call("allocate", lambda: client.pool.allocate(task_key, request_id=request_id))
        allocate_retries, steps.retries = steps.retries, 0
        steps.call("reset", lambda: lease.reset(task_name, instruction="chaos episode"))
        for call, expected in tool_calls:
            try:
                observation = tools.call("tool_call", lambda call=call: lease.tool(call["name"], **call["arguments"]))
                if expected not in str(observation):
                    lost += 1
            except StepFailed:
                lost += 1
        observation = steps.call("write", lambda: lease.tool(SOLUTION["name"], **SOLUTION["arguments"]))
        if not str(observation).startswith("Content successfully written"):
            raise StepFailed("write", "WRONG_OBSERVATION", str(observation)[:200])
        score = steps.call("evaluate", lease.evaluate).score
        if score != 1.0:
            raise StepFailed("evaluate", "WRONG_SCORE", f"score {score!r}")
        retried_before_close = steps.retries
        found = steps.call("close", lease.close)
        lease = None
        if found is not True and steps.retries == retried_before_close:  # a retried close finds it closed
            raise StepFailed("close", "NOT_FOUND_AT_CLOSE", f"found={found!r}")
        return {
            "ok": True,
            "whole": lost == 0,
            "whole_without_retries": lost == 0 and steps.retries == 0 and allocate_retries == 0,
            "lost_tool_calls": lost,
            "allocate_retries": allocate_retries,
            "step_retries": steps.retries,
        }
    except StepFailed as failed:
        return {
            "ok": False,
            "whole": False,
            "whole_without_retries": False,
            "step": failed.step,
            "code": failed.code,
            "detail": failed.detail,
            "lost_tool_calls": lost,
            "allocate_retries": allocate_retries,
            "step_retries": steps.retries,
        }
    finally:
        if lease:
            try:
                client.call("close-after-failure", lease.close)
            except StepFailed:
                pass


def probe(url: str, task_name: str, timeout: float) -> tuple[bool, str]:
    """A fresh short episode (one tool call instead of three): does the service serve a new
    episode end to end? Its requests are not counted with the scenario's."""
    client = Client(url, None, timeout)
    try:
        record = episode(client, "chaos-probe", task_name, TOOL_CALLS[:1])
    finally:
        client.close()
    if not record["ok"]:
        return False, f"{record['step']}: {record['code']}: {record['detail']}"
    return (False, "its tool call failed") if record["lost_tool_calls"] else (True, "ok")
