"""Episodes through the blocking pool API, the way a router drives them, with every request
timed and every failure recorded by its code.

One episode: allocate, reset, three tool calls (an echo, a blocking `sleep 2`, a pwd), write
the solution file, evaluate (must score 1.0), close. A failed tool call is what an agent sees
as an error observation: it is counted as a lost tool call and the episode goes on; a failure
of any other step ends the episode as failed (its lease is still closed, best effort).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import requests

SOLUTION = {"name": "shell_write_content_to_file",
            "arguments": {"content": "Hello, world!\n", "file_path": "/app/hello.txt"}}
TOOL_CALLS = (  # (tool call, what its observation must contain)
    ({"name": "shell_exec", "arguments": {"id": "a", "command": "echo chaos-hi", "block": True, "timeout": 20}},
     "chaos-hi"),
    ({"name": "shell_exec", "arguments": {"id": "a", "command": "sleep 2; echo slept", "block": True,
                                          "timeout": 20}}, "slept"),
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
            retryable = (exc is not None or status in (429, 502, 503, 504)
                         or (isinstance(data, dict) and data.get("retryable") is True))
            raise StepFailed(step, failure_code(status, data, exc), detail, retryable)
        return data

    def close(self) -> None:
        self.http.close()


def allocate(client: Client, task_key: str, keep_trying) -> tuple[str, int]:
    """A lease, asking again (same request id: allocate is idempotent) while the refusal is
    retryable and keep_trying(seconds since the first refusal) says so; returns (lease, retries)."""
    body = {"task_key": task_key, "request_id": uuid.uuid4().hex}
    first, retries = None, 0
    while True:
        try:
            return client.call("allocate", "/allocate", body)["lease_id"], retries
        except StepFailed as failed:
            first = first or time.monotonic()
            if not failed.retryable or not keep_trying(time.monotonic() - first):
                raise
        retries += 1
        time.sleep(1)


def episode(client: Client, task_key: str, task_name: str, tool_calls=TOOL_CALLS, keep_trying=None) -> dict:
    """One episode; returns its record (never raises). Only allocate is retried (no run exists
    yet, so nothing can be lost by waiting): an episode that never gets a lease was refused;
    one that fails after it got its lease is a lost run."""
    lease, lost, retries = None, 0, 0
    try:
        lease, retries = allocate(client, task_key, keep_trying or (lambda waited: False))
        meta = {"task_name": task_name, "task_path": task_name, "instruction": "chaos episode"}
        client.call("reset", "/reset", {"lease_id": lease, "task_meta": meta})
        for call, expected in tool_calls:
            try:
                reply = client.call("tool_call", "/exec_tool", {"lease_id": lease, "tool_call": call})
                if expected not in str(reply.get("observation", "")):
                    lost += 1
            except StepFailed:
                lost += 1
        reply = client.call("write", "/exec_tool", {"lease_id": lease, "tool_call": SOLUTION})
        if not str(reply.get("observation", "")).startswith("Content successfully written"):
            raise StepFailed("write", "WRONG_OBSERVATION", str(reply.get("observation"))[:200])
        score = client.call("evaluate", "/evaluate", {"lease_id": lease}).get("score")
        if score != 1.0:
            raise StepFailed("evaluate", "WRONG_SCORE", f"score {score!r}")
        found = client.call("close", "/close", {"lease_id": lease}).get("found")
        lease = None
        if found is not True:
            raise StepFailed("close", "NOT_FOUND_AT_CLOSE", f"found={found!r}")
        return {"ok": True, "lost_tool_calls": lost, "allocate_retries": retries}
    except StepFailed as failed:
        return {"ok": False, "step": failed.step, "code": failed.code, "detail": failed.detail,
                "lost_tool_calls": lost, "allocate_retries": retries}
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
