"""The floor under bench.facade's figures: the same client's calls, at the same concurrencies,
on the least a Flask + gunicorn + Celery + Redis service can be (bench/minimal_stack.py, no
Docker, no logic), in the same run and on the same machine.

| facade operation | floor call | what the floor does |
|---|---|---|
| allocate, heartbeat | POST /touch | one Redis write |
| close | POST /close | a Redis write and a job published that nobody waits for |
| non-blocking exec, view | POST /job | a Celery job, its result awaited |

No design built on this stack answers below its floor; a reference figure under the floor is a
target for another stack, not for termpool's code.
"""

from __future__ import annotations

import time
import uuid

import httpx

from bench import stack_floor
from bench.episodes import run_phase
from bench.stats import Recorder, median_of, summarize
from devstack import Stack

FLOOR_OF = {
    "allocate": "/touch",
    "heartbeat": "/touch",
    "close": "/close",
    "exec_nonblocking": "/job",
    "view": "/job",
}
WARMUP = 3


def calls_at(url: str, path: str, concurrency: int, calls: int) -> Recorder:
    """`concurrency` threads, one keep-alive connection each, `calls` calls of `path` each
    (bench/episodes.py run_phase, as bench.stack_floor drives the same stack); RuntimeError
    with the first failures."""

    def one_call(http: httpx.Client, _index: int, rec: Recorder) -> bool:
        began = time.perf_counter()
        try:
            reply = http.post(path, json={"id": uuid.uuid4().hex})
        except httpx.HTTPError as exc:
            rec.error(f"{path}: {type(exc).__name__}: {exc}")
            return False
        rec.add(path, (time.perf_counter() - began) * 1000)
        if reply.status_code != 200:
            rec.error(f"{path}: {reply.status_code} {reply.text[:200]}")
        return reply.status_code == 200

    rec, _ = run_phase(
        concurrency, calls, lambda _: httpx.Client(base_url=url, timeout=60), one_call, lambda http: http.close()
    )
    if rec.error_count:
        raise RuntimeError("; ".join(rec.error_messages[:3]))
    return rec


def measure(calls: int, repeats: int, levels: list[int]) -> dict:
    """{c: {path: median-of-repeats stats}} for each floor call, on a minimal stack of its own."""
    stack = Stack()
    figures: dict = {}
    try:
        stack.start_redis()
        stack_floor.start(stack, max(levels), flower=False)
        for c in levels:
            figures[str(c)] = {}
            for path in sorted(set(FLOOR_OF.values())):
                calls_at(stack.url, path, c, WARMUP)
                repeats_seen = [summarize(calls_at(stack.url, path, c, calls).samples[path]) for _ in range(repeats)]
                stats = median_of(repeats_seen)
                figures[str(c)][path] = {"p50": stats["p50"], "p95": stats["p95"]} | {
                    "repeat_p50s": [r["p50"] for r in repeats_seen]
                }
    finally:
        stack.stop()
    return figures


def beside(levels: dict, floor: dict) -> None:
    """Each operation's floor p50 and its own p50 as a multiple of it, into bench.facade's levels."""
    for c, ops in levels.items():
        for op, figures in ops.items():
            under = floor.get(c, {}).get(FLOOR_OF[op])
            if under and under["p50"]:
                figures["floor_p50"] = under["p50"]
                figures["vs_floor"] = round(figures["p50"] / under["p50"], 2)
