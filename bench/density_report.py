"""bench/density.py's result as a short Markdown report: one table per phase, the targets of
issue 29 checked (informational: timings never change the exit status), and where the CPU went."""

from __future__ import annotations

TOOL_CALL_TARGET = 2.0  # loaded tool call p50 within 2x of c=1
STORM_TARGET = 1.3  # storm total within 1.3x of the raw floor
CPU_GROUPS = 8  # process groups shown per window, most CPU first


def markdown(result: dict) -> str:
    loads = [f"before {result['load_before']}"]
    loads += [
        f"after {key[len('load_after_') :]} {value}" for key, value in result.items() if key.startswith("load_after_")
    ]
    outcome = "ok" if result["ok"] else "FAILED"
    lines = [f"# Density benchmark, {result['date']}", "", f"Command: `{result['command']}`  "]
    lines.append(f"Machine: {result['machine']}; load average (1, 5, 15 min) {', '.join(loads)}  ")
    lines.append(f"Result: {outcome}; left behind: {_left(result['left_behind'])}; ")
    lines[-1] += f"failed operations: {result['failures'] or 'none'}"
    closes = [f"{phase} {c['runs']} runs in {c['seconds']} s" for phase, c in (result.get("closes") or {}).items()]
    if closes:
        lines.append(f"Closing every run of a phase, until /status shows the last teardown done: {'; '.join(closes)}")
    if result.get("floor_failures"):
        lines.append(f"Floor (raw SDK) failures, Docker's own: {result['floor_failures']}")
    for phase, render in (("density", _density), ("latency", _latency), ("storm", _storm)):
        if phase in result:
            lines += ["", *render(result[phase])]
    return "\n".join(lines) + "\n"


def _left(left: dict) -> str:
    """Counts by kind per phase, with a first name each (the JSON has them all)."""
    found = [
        f"{phase}: {len(names)} {kind} (e.g. {names[0]})"
        for phase, kinds in left.items()
        for kind, names in kinds.items()
        if names
    ]
    return "; ".join(found) or "nothing"


def _density(found: dict) -> list[str]:
    base = found["before"]
    lines = [
        "## Density: N live runs of two-service-small, memory per idle run",
        "",
        f"Before the first run: termpool {base['termpool_mb']['total']} MB RSS, MemAvailable "
        f"{base['mem_available_mb']} MB, Docker's daemons {base['docker_daemons_mb']} MB.",
        "",
        "| N live | answered (distinct sidecars) | start s | probe p50 / p95 ms | termpool MB/run (Redis used KB/run) "
        "| containers MB/run (by service) | their shims MB/run (PSS) | sum | MemAvailable fall MB/run | runs memory allows "
        "| /status networks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in found["levels"]:
        per, probe = row["per_run_mb"], row["probe_ms"]
        services = ", ".join(f"{k[len('container_') :]} {per[k]}" for k in sorted(per) if k.startswith("container_"))
        lines.append(
            f"| {row['live']} | {row['answered']} ({row['distinct_sidecars']}) | {row['start_s']} "
            f"| {probe.get('p50', '-')} / {probe.get('p95', '-')} | {per['termpool']} ({round(per['redis_used'] * 1024)}) "
            f"| {per['containers']} ({services}) | {per['docker_shims']} | {per['attributed']} | {per['host_mem_available']} "
            f"| {per['runs_memory_allows']} | {_networks(row['snapshot']['status'])} |"
        )
    for row in found["levels"]:
        if row.get("idle_cpu"):
            lines += ["", *_cpu(f"Idle at {row['live']} live runs, CPU-seconds", row["idle_cpu"])]
    return lines


def _networks(status: dict) -> str:
    found = status.get("networks")
    return f"{found['in_use']} of {found['total']} ({found['free']} free)" if found else "-"


def _pair(stats: dict) -> str:
    return f"{stats['p50']} / {stats['p95']}"


def _latency(found: dict) -> list[str]:
    lines = [
        "## Latency at density (ms, p50 / p95; medians over repeats)",
        "",
        "| op | c=1 alone | c=1 beside the held runs | in flight | in flight p50 / c=1 p50 | in flight p95 / c=1 p50 |",
        "|---|---|---|---|---|---|",
    ]
    for op, row in found["ops"].items():
        lines.append(
            f"| {op} | {_pair(row['c1_alone'])} | {_pair(row['c1'])} | {_pair(row['loaded'])} "
            f"| {row['loaded_p50_over_c1_p50']} | {row['loaded_p95_over_c1_p50']} |"
        )
    ratio = found["ops"]["tool_call"]["loaded_p50_over_c1_p50"]
    met = ratio is not None and ratio <= TOOL_CALL_TARGET
    lines += [
        "",
        f"Target, tool call p50 within {TOOL_CALL_TARGET}x of c=1: {ratio}x ({'met' if met else 'not met'}); "
        f"against c=1 with nothing else live: {found['tool_call_loaded_over_c1_alone']}x. Runs held live: "
        f"{found['live_held']}; in-flight windows took {found['episodes_wall_s']} s.",
        "",
        *_cpu("CPU-seconds over the first in-flight window", found["cpu_loaded"][0]),
    ]
    return lines


def _storm(found: dict) -> list[str]:
    lines = [
        f"## Start storm: {found['size']} at once (seconds from the release to the last answer)",
        "",
        "| round | floor (raw SDK) s | termpool s | termpool / floor | started (floor) | floor p50 ms | reset p50 / p95 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(found["rounds"]):
        lines.append(
            f"| {i} | {r['floor_s']} | {r['termpool_s']} | {r['ratio']} | {r['started']} ({r['floor_started']}) "
            f"| {r['floor_p50_ms']} | {r['reset_p50_ms']} / {r['reset_p95_ms']} |"
        )
    ratio = found["ratio_median"]
    lines += [
        "",
        f"Target, storm within {STORM_TARGET}x of the floor: median {ratio}x "
        f"({'met' if ratio <= STORM_TARGET else 'not met'}).",
        "",
        *_cpu("CPU-seconds over the first floor storm", found["rounds"][0]["cpu_floor"]),
        "",
        *_cpu("CPU-seconds over the first termpool storm", found["rounds"][0]["cpu_termpool"]),
    ]
    return lines


def _cpu(title: str, window: dict) -> list[str]:
    """The window's CPU by process group, and py-spy's Python CPU per profiled process."""
    cpu = dict(window["cpu_s"])
    machine = cpu.pop("machine", 0.0)
    top = sorted(cpu.items(), key=lambda item: -item[1])[:CPU_GROUPS]
    lines = [
        f"{title} ({window['wall_s']} s wall, {machine} CPU-s on the whole machine, of "
        f"{round(2 * window['wall_s'], 1)} on 2 cores): " + ", ".join(f"{k} {v}" for k, v in top)
    ]
    for proc, spy in (window.get("python") or {}).items():
        packages = ", ".join(f"{k} {v}" for k, v in spy["by_package_s"].items())
        lines.append(f"- py-spy, {proc}: {spy['python_cpu_s']} CPU-s of Python holding the GIL ({packages})")
    spy = (window.get("python") or {}).get("lifecycle")
    if spy and "lifecycle" in cpu:  # the worker's tree counts the compose processes it ran
        rest = round(cpu["lifecycle"] - spy["python_cpu_s"], 2)
        lines.append(f"- lifecycle's tree {cpu['lifecycle']} CPU-s, {rest} of it not Python: its compose processes")
    return lines
