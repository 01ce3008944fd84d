"""The chaos suite's table (markdown) and one-line summaries."""

from __future__ import annotations

LEFTOVER_LABELS = (  # key in the leftovers record -> how the table names it
    ("containers", "containers"),
    ("networks", "networks"),
    ("socket_dirs", "socket dirs"),
    ("slots_held", "slots held"),
    ("closes_pending", "closes pending"),
    ("redis_locks", "Redis locks"),
    ("temp_files", "temp files"),
    ("processes", "processes"),
    ("packet_rules", "packet-filter rules"),
)
COLUMNS = (
    "scenario",
    "fault",
    "episodes ok",
    "whole: without retries / with them",
    "runs lost",
    "refused",
    "failed by code (step)",
    "steps retried",
    "tool calls lost",
    "requests failed (after the fault's end)",
    "longest request",
    "recover",
    "not running after",
    "leftovers",
)


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f} s"


def leftovers_cell(left: dict) -> str:
    parts = []
    for key, label in LEFTOVER_LABELS:
        value = left.get(key)
        n = len(value) if isinstance(value, list) else (value or 0)
        if n:
            parts.append(f"{n} {label}")
    if left.get("slots_held") is None and "slots_held" in left:
        parts.append("capacity unreadable")
    return ", ".join(parts) or "0"


def recover_cell(result: dict) -> str:
    if result.get("error"):
        return "-"
    if result.get("recover_s") is not None:
        return _seconds(result["recover_s"])
    return "never (service exited)" if result.get("service_exited") else "never"


def longest_cell(result: dict) -> str:
    if not result.get("requests"):
        return "-"
    cell = f"{_seconds(result['longest_request_s'])} ({result['longest_request_step']})"
    if result.get("requests_over_20s"):
        cell += f"; {result['requests_over_20s']} > 20 s"
    return cell


def _counts(by_code: dict) -> str:
    return ", ".join(f"{n}x {code}" for code, n in by_code.items()) or "-"


def fault_cell(result: dict) -> str:
    """The fault, with what it did (pids stopped, seconds to /healthz) or why it was not applied."""
    detail = result.get("fault_detail") or {}
    cell = result["fault"]
    if detail.get("note"):
        cell += f" ({detail['note']})"
    if detail.get("error"):
        cell += f" [fault failed: {detail['error'][:100]}]"
    return cell


def requests_failed_cell(result: dict) -> str:
    """Every failed request by code; after the fault's end (its mark), by code and step."""
    cell = _counts(result.get("request_failures_by_code") or {})
    mark = result.get("failed_after")
    if mark:
        cell += f"; after {mark}: {_counts(result.get(f'failed_after_{mark}_by_code') or {})}"
        if result.get("last_failure_after_s") is not None:
            cell += f" (the last {result['last_failure_after_s']:g} s after)"
    return cell


def row(result: dict) -> list[str]:
    if result.get("error"):
        return [
            result["scenario"],
            result["fault"],
            "-",
            "-",
            "-",
            "-",
            result["error"][:120],
            "-",
            "-",
            "-",
            "-",
            "-",
            "-",
            leftovers_cell(result.get("leftovers", {})),
        ]
    return [
        result["scenario"],
        fault_cell(result),
        f"{result['episodes_ok']}/{result['episodes']}",
        f"{result.get('episodes_whole_without_retries', '-')} / {result.get('episodes_whole', '-')}",
        str(result["runs_lost"]),
        str(result["refused"]),
        _counts(result["failed_by_code"]),
        str(result.get("step_retries", 0)),
        str(result["lost_tool_calls"]),
        requests_failed_cell(result),
        longest_cell(result),
        recover_cell(result),
        ", ".join(result.get("not_running_after") or []) or "-",
        leftovers_cell(result.get("leftovers", {})),
    ]


def table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row(r)) + " |" for r in results]
    return "\n".join(lines)


def one_line(result: dict) -> str:
    return "; ".join(f"{name}: {cell}" for name, cell in zip(COLUMNS[2:], row(result)[2:]))


def document(meta: dict, table_text: str) -> str:
    return (
        f"# Chaos suite results, {meta['date']}\n\n"
        f"Commit {meta['commit']}; {meta['episodes']} episodes per scenario, {meta['concurrency']} at once; "
        f"fault {meta['fault_after_s']:g} s in (worker kills wait until their kind of job is running); "
        f"client timeout {meta['request_timeout_s']:g} s per request; recovery given up after "
        f"{meta['recover_limit_s']:g} s. Load average at start {meta['loadavg_at_start']} on "
        f"{meta['cpus']} CPUs.\n\n{table_text}\n"
    )
