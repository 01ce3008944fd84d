"""Runs of the two-service fixture task driven in bulk through the pool API (bench/density.py,
tests/test_density.py): many leases started, asked and closed from a pool of threads, each
thread with its own client (one keep-alive connection each, as a router has per worker).

Every failed operation is counted by its code (termpool.client's typed errors), so a report
can tell a start that failed for termpool's own reasons from one the task caused."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from bench.episodes import ECHO_COMMAND, ECHO_OUTPUT, BenchClient
from bench.stats import Recorder
from termpool.client.errors import TermpoolError

TASK = "two-service-small"
# The agent's side of the run's network: bash's /dev/tcp to the sidecar by its service name,
# retried while the sidecar starts (no healthcheck: compose starts it first, not ready first).
PROBE = (
    "for i in $(seq 50); do exec 3<>/dev/tcp/side/7000 && break; sleep 0.1; done 2>/dev/null;"
    " head -n 1 <&3 | tee /app/reply.txt"
)
REPLY = re.compile(r"pong ([0-9a-f]{12})")


def side_of(reply: str) -> str:
    """The short container id of the sidecar that answered the probe ("" for another reply)."""
    found = REPLY.fullmatch(reply.strip())
    return found[1] if found else ""


class Fleet:
    """Live leases of the task on one stack."""

    def __init__(self, url: str, task_key: str = TASK, parallel: int = 16, token: str | None = None):
        self.url = url
        self.token = token  # a tenant's (TENANTS_FILE), or None for a pool without tokens
        self.task_key = task_key
        self.parallel = parallel
        self.leases: list[str] = []
        self.ever: list[str] = []  # every lease this fleet started, closed or not
        self.codes: Counter = Counter()  # failed operations by "<op> <code>"
        self._local = threading.local()
        self._clients: list[BenchClient] = []
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(parallel)  # one pool for the fleet's life: its clients stay

    def client(self) -> BenchClient:
        """This thread's client."""
        if not hasattr(self._local, "client"):
            self._local.client = BenchClient(self.url, self.token)
            with self._lock:
                self._clients.append(self._local.client)
        return self._local.client

    def failed(self, rec: Recorder, op: str, exc: Exception) -> None:
        code = exc.code if isinstance(exc, TermpoolError) else type(exc).__name__
        with self._lock:
            self.codes[f"{op} {code}"] += 1
        rec.error(f"{op}: {code}: {exc}"[:500])

    def map(self, fn, items) -> list:
        """fn over items from the fleet's threads, `parallel` at a time."""
        return list(self._threads.map(fn, items))

    def grow(self, n: int, rec: Recorder) -> float:
        """Start runs until n are live; the wall seconds it took. A failed start is counted."""
        began = time.perf_counter()
        for lease in self.map(lambda _: self.start_one(rec), range(n - len(self.leases))):
            if lease:
                self.leases.append(lease)
        return time.perf_counter() - began

    def allocate(self, rec: Recorder) -> str:
        """A lease (not yet reset), or "" when allocate failed."""
        try:
            lease = self.client().allocate(self.task_key).id
        except Exception as exc:
            self.failed(rec, "allocate", exc)
            return ""
        with self._lock:
            self.ever.append(lease)
        return lease

    def reset(self, lease: str, rec: Recorder) -> bool:
        began = time.perf_counter()
        try:
            self.client().lease(lease).reset(self.task_key, instruction="density benchmark")
        except Exception as exc:
            self.failed(rec, "reset", exc)
            self.close_one(lease, rec)
            return False
        rec.add("reset", (time.perf_counter() - began) * 1000)
        return True

    def start_one(self, rec: Recorder) -> str:
        lease = self.allocate(rec)
        return lease if lease and self.reset(lease, rec) else ""

    def reset_kept(self, lease: str, rec: Recorder) -> bool:
        """Reset an allocated lease and hold it live (close_all closes it)."""
        if not self.reset(lease, rec):
            return False
        with self._lock:
            self.leases.append(lease)
        return True

    def call(self, lease: str, command: str, rec: Recorder, op: str) -> str:
        """One blocking shell_exec; its output ("" when it failed, counted)."""
        began = time.perf_counter()
        try:
            output = self.client().lease(lease).exec(command, id="density", timeout=60)
        except Exception as exc:
            self.failed(rec, op, exc)
            return ""
        rec.add(op, (time.perf_counter() - began) * 1000)
        return output

    def probe_all(self, rec: Recorder) -> dict[str, str]:
        """Every live run asks its own sidecar; lease -> the sidecar id that answered ("" if none)."""
        sides = self.map(lambda lease: side_of(self.call(lease, PROBE, rec, "probe")), self.leases)
        return dict(zip(self.leases, sides))

    def close_one(self, lease: str, rec: Recorder) -> None:
        try:
            self.client().lease(lease).close()
        except Exception as exc:
            self.failed(rec, "close", exc)

    def close_all(self, rec: Recorder) -> None:
        leases, self.leases = self.leases, []
        self.map(lambda lease: self.close_one(lease, rec), leases)

    def stop(self) -> None:
        self._threads.shutdown()
        for client in self._clients:
            client.close()


def episode(fleet: Fleet, rec: Recorder, tool_calls: int, think: float) -> bool:
    """A whole episode of the task: start, `tool_calls` x `echo hi` (`think` seconds apart, an
    agent's model time), the sidecar probe (which writes the answer), evaluate (must be 1.0),
    close. Samples: reset, tool_call, probe, evaluate."""
    lease = fleet.start_one(rec)
    if not lease:
        return False
    try:
        for _ in range(tool_calls):
            time.sleep(think)
            if fleet.call(lease, ECHO_COMMAND, rec, "tool_call").strip() != ECHO_OUTPUT:
                return False
        if not side_of(fleet.call(lease, PROBE, rec, "probe")):
            return False
        began = time.perf_counter()
        score = fleet.client().lease(lease).evaluate().score
        rec.add("evaluate", (time.perf_counter() - began) * 1000)
        if score != 1.0:
            rec.error(f"evaluate: score {score!r}, expected 1.0")
        return score == 1.0
    except Exception as exc:
        fleet.failed(rec, "evaluate", exc)
        return False
    finally:
        fleet.close_one(lease, rec)


def wait_closed(stack, limit: float = 600.0, headers: dict | None = None) -> bool:
    """Wait until /status shows no live run and no pending close (every teardown ended);
    `headers` carry the operator's token on a pool that has one."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        pool = stack.get("/status", headers=headers or {}).json()["pool"]
        if not pool["total_active_runs"] and not pool["pending_closes"]:
            return True
        time.sleep(0.5)
    return False
