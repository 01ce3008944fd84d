"""bench/storm.py's figures: B's calls storm against alone, and what each waited on.

A job record (poolcore/state/jobs.py) has queued_at (the facade recorded and sent it),
started_at (a worker took it) and finished_at (its result was recorded), wall-clock seconds from
one machine's clock. Paired with the client's time of the call that made it, a call splits into:

- outside: client time less (finished_at - queued_at): the facade before it sent the job and
  after the result was recorded (its wait for the result included), HTTP both ways;
- queue: started_at - queued_at: the message on the host's queue until a worker took it;
- run: finished_at - started_at: the worker's work, mostly Docker's (an exec, a container start).
"""

from __future__ import annotations

from bench.stats import percentile, summarize

# The job kind each client operation makes (one job per call), in the order the calls were made.
KIND_OF = {"tool_call": "tool_call", "reset": "start"}
PARTS = ("client", "outside", "queue", "run")
TOOL_CALL_TARGET = 1.5  # issue 38: B's tool-call p50 storm / alone at most
RESET_TARGET = 2.0  # and its reset's


def breakdown(jobs: list[dict], samples: dict[str, list[float]]) -> list[dict]:
    """One row per timed call that has its job: op, client ms and its parts (ms)."""
    rows = []
    for op, kind in KIND_OF.items():
        mine = [job for job in jobs if job.get("kind") == kind and job.get("started_at") and job.get("finished_at")]
        for client_ms, job in zip(samples.get(op, []), mine):
            queued, started, finished = (float(job[k]) for k in ("queued_at", "started_at", "finished_at"))
            rows.append(
                {
                    "op": op,
                    "client": client_ms,
                    "outside": client_ms - (finished - queued) * 1000,
                    "queue": (started - queued) * 1000,
                    "run": (finished - started) * 1000,
                }
            )
    return rows


def parts(rows: list[dict], op: str) -> dict:
    """p50 / p95 of each part of op's calls, and each part's share of the client time summed."""
    mine = [row for row in rows if row["op"] == op]
    if not mine:
        return {"n": 0}
    total = sum(row["client"] for row in mine)
    out: dict = {"n": len(mine)}
    for part in PARTS:
        values = [row[part] for row in mine]
        out[part] = {"p50": round(percentile(values, 50), 1), "p95": round(percentile(values, 95), 1)}
        if part != "client":
            out[part]["share"] = round(sum(values) / total, 3) if total else None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def side(rec, rows: list[dict]) -> dict:
    return {
        "episodes_ok": rec.episodes_ok,
        "episodes_failed": rec.episodes_failed,
        **{op: summarize(rec.samples.get(op, [])) for op in KIND_OF},
        "waited_on": {op: parts(rows, op) for op in KIND_OF},
    }


def report(args, alone, alone_rows: list[dict], storm, storm_rows: list[dict], a: dict) -> dict:
    """The result's figures: sizes, B alone, B in A's storm, their ratios against the targets, A's."""
    b_alone, b_storm = side(alone, alone_rows), side(storm, storm_rows)
    ratios = {
        f"{op}_{q}": ratio(b_storm[op][q], b_alone[op][q]) for op in ("tool_call", "reset") for q in ("p50", "p95")
    }
    return {
        "sizes": {
            "storm_runs": args.storm_runs,
            "storm_episodes": args.storm_episodes,
            "a_tool_calls": args.a_tool_calls,
            "b_episodes": args.b_episodes,
            "b_tool_calls": args.b_tool_calls,
            "think_s": list(args.think),
        },
        "b_alone": b_alone,
        "b_storm": b_storm,
        "storm_over_alone": ratios,
        "targets": {
            "tool_call_p50": {"max": TOOL_CALL_TARGET, "met": _met(ratios["tool_call_p50"], TOOL_CALL_TARGET)},
            "reset_p50": {"max": RESET_TARGET, "met": _met(ratios["reset_p50"], RESET_TARGET)},
        },
        "a": a,
    }


def _met(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit
