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
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import requests

SOLUTION = {
    "name": "shell_write_content_to_file",
    "arguments": {"content": "Hello, world!\n", "file_path": "/app/hello.txt"},
}
TOOL_CALLS = (  # (tool call, what its observation must contain)
    (
        {"name": "shell_exec", "arguments": {"id": "a", "command": "echo chaos-hi", "block": True, "timeout": 20}},
        "chaos-hi",
    ),
    (
        {
            "name": "shell_exec",
            "arguments": {"id": "a", "command": "sleep 2; echo slept", "block": True, "timeout": 20},
        },
        "slept",
    ),
    ({"name": "shell_exec", "arguments": {"id": "b", "command": "pwd", "block": True, "timeout": 20}}, "/"),
)


class StepFailed(Exception):
    def __init__(self, step: str, code: str, detail: str, retryable: bool = False):
        super().__init__(f"{step}: {code}: {detail}")
        self.step, self.code, self.detail, self.retryable = step, code, detail, retryable


@dataclass
class Log:
    """Every request of a scenario's episodes (thread-safe): durations and failures."""

    requests: list = field(default_factory=list)  # (step, seconds, ok)
    episodes: list = field(default_factory=list)  # {"ok", "step", "code", "detail", "lost_tool_calls"}
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, step: str, seconds: float, ok: bool) -> None:
        with self.lock:
            self.requests.append((step, round(seconds, 3), ok))

    def episode(self, record: dict) -> None:
        with self.lock:
            self.episodes.append(record)


def failure_code(status: int | None, data, exc: Exception | None = None) -> str:
    """The reply's `code` when it has one, else the HTTP status or the client error's class."""
    if exc is not None:
        return type(exc).__name__
    if isinstance(data, dict) and data.get("code"):
        return str(data["code"])
    return f"HTTP {status}"


class Client:
    """The pool API over one keep-alive session; every request is timed into the log."""

    def __init__(self, url: str, log: Log | None, timeout: float):
        self.url, self.log, self.timeout = url, log, timeout
        self.http = requests.Session()

    def call(self, step: str, path: str, body: dict, timeout: float | None = None) -> dict:
        start = time.monotonic()
        status, data, exc = None, None, None
        try:
            reply = self.http.post(self.url + path, json=body, timeout=timeout or self.timeout)
            status = reply.status_code
            try:
                data = reply.json()
            except ValueError:
                data = None
        except requests.RequestException as error:
            exc = error
        seconds = time.monotonic() - start
        good = exc is None and status == 200 and isinstance(data, dict) and data.get("ok") is True
        if self.log is not None:
            self.log.request(step, seconds, good)
        if not good:
            detail = str(exc)[:200] if exc is not None else str((data or {}).get("error", ""))[:200]
            retryable = (
                exc is not None
                or status in (429, 502, 503, 504)
                or (isinstance(data, dict) and data.get("retryable") is True)
            )
            raise StepFailed(step, failure_code(status, data, exc), detail, retryable)
        return data

    def close(self) -> None:
        self.http.close()


class Retrying:
    """Sends an idempotent step again while its failure is retryable and keep_trying(seconds
    since the step's first failure) says so; counts the retries."""

    def __init__(self, client: Client, keep_trying):
        self.client, self.keep_trying, self.retries = client, keep_trying, 0

    def call(self, step: str, path: str, body: dict) -> dict:
        first = None
        while True:
            try:
                return self.client.call(step, path, body)
            except StepFailed as failed:
                first = first or time.monotonic()
                if not failed.retryable or not self.keep_trying(time.monotonic() - first):
                    raise
            self.retries += 1
            time.sleep(1)


def episode(client: Client, task_key: str, task_name: str, tool_calls=TOOL_CALLS, keep_trying=None) -> dict:
    """One episode; returns its record (never raises). An episode that never gets a lease was
    refused; one whose step fails for good after it got its lease is a lost run. Allocate (same
    request id) and the idempotent steps are retried while retryable; tool calls never are."""
    lease, lost = None, 0
    steps = Retrying(client, keep_trying or (lambda waited: False))
    allocate_retries = 0
    try:
        lease = steps.call("allocate", "/allocate", {"task_key": task_key, "request_id": uuid.uuid4().hex})["lease_id"]
        allocate_retries, steps.retries = steps.retries, 0
        meta = {"task_name": task_name, "task_path": task_name, "instruction": "chaos episode"}
        steps.call("reset", "/reset", {"lease_id": lease, "task_meta": meta})
        for call, expected in tool_calls:
            try:
                reply = client.call("tool_call", "/exec_tool", {"lease_id": lease, "tool_call": call})
                if expected not in str(reply.get("observation", "")):
                    lost += 1
            except StepFailed:
                lost += 1
        reply = steps.call("write", "/exec_tool", {"lease_id": lease, "tool_call": SOLUTION})
        if not str(reply.get("observation", "")).startswith("Content successfully written"):
            raise StepFailed("write", "WRONG_OBSERVATION", str(reply.get("observation"))[:200])
        score = steps.call("evaluate", "/evaluate", {"lease_id": lease}).get("score")
        if score != 1.0:
            raise StepFailed("evaluate", "WRONG_SCORE", f"score {score!r}")
        retried_before_close = steps.retries
        found = steps.call("close", "/close", {"lease_id": lease}).get("found")
        lease = None
        if found is not True and steps.retries == retried_before_close:  # a retried close finds it closed
            raise StepFailed("close", "NOT_FOUND_AT_CLOSE", f"found={found!r}")
        return {
            "ok": True,
            "lost_tool_calls": lost,
            "allocate_retries": allocate_retries,
            "step_retries": steps.retries,
        }
    except StepFailed as failed:
        return {
            "ok": False,
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
                client.call("close-after-failure", "/close", {"lease_id": lease}, timeout=30)
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
