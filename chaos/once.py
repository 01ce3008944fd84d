"""Jobs that run once, seen as a user sees them: every tool call appends its own line to a file
in its run's container while Redis is frozen, partitioned and restarted and the exec worker is
killed; at the end each call that answered ok must be in its file exactly once, and no call
twice (a call that failed may be there once: it may have run before its failure).

    python -m chaos.once [--episodes 8] [--calls 40] [--concurrency 8] [--json F] [--markdown F] [--logs D]

The service runs as `scripts/serve.sh` runs it (chaos/service.py). Half the episodes use the
runs API, half the pool API, both through termpool's client (which gives every job-queuing
request an Idempotency-Key and sends it again after a lost reply or REDIS_UNAVAILABLE). The
faults come one after another, FAULT_GAP s apart, while the calls go on.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chaos import faults, leftovers
from chaos.episodes import probe
from chaos.run import finish, machine
from chaos.service import BASE_TASK, Service, scratch_dir
from termpool.client import Pool, TermpoolError

LOG = "/tmp/calls.log"
FAULT_GAP = 4.0  # seconds between two faults (and before the first)
FREEZE_SECONDS = 10.0
PARTITION_SECONDS = 10.0
THINK_SECONDS = 0.2  # between two calls of an episode, as an agent's turn
REQUEST_TIMEOUT = 60.0


def faults_in_turn(service: Service, undo: faults.Undo, stop: threading.Event, done: threading.Event) -> list[dict]:
    """Redis frozen, partitioned, restarted; then the exec worker killed mid-call; `done` set
    FAULT_GAP s after the last."""
    steps = [
        lambda: faults.freeze_redis(service, undo, FREEZE_SECONDS),
        lambda: faults.partition_redis(service, undo, PARTITION_SECONDS),
        lambda: faults.restart_redis(service),
        lambda: faults.kill_role(service, "exec", service.celery()),
    ]
    injected = []
    for step in steps:
        if stop.wait(FAULT_GAP):
            break
        began = time.monotonic()
        info = step()
        injected.append({**info, "took_s": round(time.monotonic() - began, 1)})
    stop.wait(FAULT_GAP)
    done.set()
    return injected


def episode(url: str, index: int, calls: int, faults_done: threading.Event) -> dict:
    """A run (runs API for even indexes, a lease of the pool API for odd ones) whose calls each
    append their own id, `calls` of them and more until the faults are over; then the file is
    read back."""
    face = "runs" if index % 2 == 0 else "pool"
    outcome = {"face": face, "calls": {}, "error": None}
    with Pool(url, timeout=REQUEST_TIMEOUT, job_timeout=300, retries=8, backoff=0.5) as pool:
        try:
            session = pool.start(BASE_TASK) if face == "runs" else pool.allocate(BASE_TASK)
            if face == "pool":
                session.reset(BASE_TASK)
        except TermpoolError as exc:
            outcome["error"] = f"start: {exc.code}: {exc}"
            return outcome
        n = 0
        while n < calls or not faults_done.is_set():
            call_id, n = f"e{index}c{n}", n + 1
            try:
                session.exec(f"echo {call_id} >> {LOG}", timeout=30)
                outcome["calls"][call_id] = "ok"
            except TermpoolError as exc:
                outcome["calls"][call_id] = exc.code or "ERROR"
            time.sleep(THINK_SECONDS)
        outcome["lines"] = read_back(session)
        with_suppressed_close(session)
    return outcome


def read_back(session) -> list[str] | None:
    """The file's lines, read once the faults are over (tried for up to a minute)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return session.exec(f"touch {LOG}; cat {LOG}", timeout=30).split()
        except TermpoolError:
            if time.monotonic() > deadline:
                return None
            time.sleep(2)


def with_suppressed_close(session) -> None:
    try:
        session.close()
    except TermpoolError:
        pass  # its run is reaped or reconciled away: leftovers are counted after


def judge(outcomes: list[dict]) -> dict:
    """Each ok call exactly once, no call twice."""
    answered = collections.Counter()
    ok_missing, twice, failed_present, unread = [], [], [], 0
    for outcome in outcomes:
        if outcome.get("lines") is None:
            unread += 1
            continue
        seen = collections.Counter(outcome["lines"])
        for call_id, result in outcome["calls"].items():
            answered[result] += 1
            if seen[call_id] > 1:
                twice.append(call_id)
            if result == "ok" and seen[call_id] != 1:
                ok_missing.append(call_id)
            if result != "ok" and seen[call_id] == 1:
                failed_present.append(call_id)
    return {
        "calls_by_answer": dict(answered),
        "ok_not_exactly_once": ok_missing,
        "present_twice": twice,
        "failed_but_ran": failed_present,
        "episodes_unread": unread,
        "start_errors": [o["error"] for o in outcomes if o["error"]],
        "holds": not ok_missing and not twice and not unread,
    }


def run(episodes: int, calls: int, concurrency: int, logs: Path) -> dict:
    service = Service(scratch_dir(), {})
    result: dict = {"scenario": "exactly-once", "episodes": episodes, "calls_per_episode": calls, **machine()}
    started, undo, stop, faults_done = time.monotonic(), faults.Undo(), threading.Event(), threading.Event()
    try:
        service.start()
        ok, why = probe(service.url, BASE_TASK, 120)
        if not ok:
            raise RuntimeError(f"warm-up episode failed: {why}")
        with ThreadPoolExecutor(concurrency + 1) as threads:
            injected = threads.submit(faults_in_turn, service, undo, stop, faults_done)
            outcomes = list(threads.map(lambda i: episode(service.url, i, calls, faults_done), range(episodes)))
            stop.set()
            result["faults"] = injected.result()
        result.update(judge(outcomes))
        result["settle_s"] = leftovers.settle(service)
        result["leftovers"] = leftovers.measure(service)
    except Exception as exc:  # the harness's own failure: reported
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        faults_done.set()
        undo.close()
        finish(service, result, logs, started)
    return result


def markdown(result: dict) -> str:
    faults_cell = "; ".join(f"{f.get('role')}: {f.get('note') or f.get('action')}" for f in result.get("faults", []))
    return "\n".join(
        [
            "| episodes x calls | faults | calls by answer | ok calls not exactly once | calls twice | holds |",
            "|---|---|---|---|---|---|",
            f"| {result['episodes']} x {result['calls_per_episode']} | {faults_cell} | "
            f"{result.get('calls_by_answer')} | {len(result.get('ok_not_exactly_once', []))} | "
            f"{len(result.get('present_twice', []))} | {result.get('holds')} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.once", description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--logs", type=Path, help="the service's logs (default: a temp folder)")
    args = parser.parse_args(argv)
    result = run(args.episodes, args.calls, args.concurrency, args.logs or scratch_dir())
    table = markdown(result)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0 if result.get("holds") and not result.get("error") else 1


if __name__ == "__main__":
    raise SystemExit(main())
