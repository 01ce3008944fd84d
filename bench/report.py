"""From raw phase records to the reported figures: medians of per-repeat statistics, ratios to
the floor, issue 4's targets and a Markdown table (the PNG chart: bench/report_chart.py)."""

from __future__ import annotations

from bench.episodes import FLOOR_EXTRA_OPS, FLOOR_OPS, POOL_OPS, RUNS_OPS
from bench.stats import median_of, median_value, summarize

FACE_OPS = {"pool": POOL_OPS, "runs": RUNS_OPS, "floor": FLOOR_OPS + FLOOR_EXTRA_OPS}
# (name, termpool op, floor op, how): ratio = termpool / floor; diff_ms = termpool - floor
PAIRS = {
    "pool": [
        ("reset/create_start", "reset", "create_start", "ratio"),
        ("tool_call/exec", "tool_call", "exec", "ratio"),
        ("write_file/put_archive", "write_file", "put_archive", "ratio"),
        ("evaluate-test_script_ms", "evaluate", "test_script", "diff_ms"),
    ],
    "runs": [
        ("start/create_start", "start", "create_start", "ratio"),
        ("tool_call/exec", "tool_call", "exec", "ratio"),
        ("write_file/put_archive", "write_file", "put_archive", "ratio"),
        ("evaluate-test_script_ms", "evaluate", "test_script", "diff_ms"),
    ],
}
MEMORY_LIMIT_MB = 1536.0  # issue 4: termpool's processes under 1.5 GiB together
# CPU groups (bench/monitor.py): termpool's own processes, Docker's, and the rest.
TERMPOOL_KINDS = ("facade", "build", "lifecycle", "exec", "eval", "teardown", "beat", "flower")
DOCKER_KINDS = ("dockerd", "containerd", "containerd-shim", "runc")
CPU_COLUMNS = (
    "termpool",
    *TERMPOOL_KINDS,
    "redis",
    "docker",
    *DOCKER_KINDS,
    "containers",
    "bench",
    "other",
    "machine",
)


def _compare(a, b, how: str):
    if a is None or b is None:
        return None
    if how == "diff_ms":
        return round(a - b, 1)
    return round(a / b, 3) if b > 0 else None


def cpu_per_episode(cpu: dict | None, episodes: int) -> dict:
    """CPU-seconds per finished episode by group, with the totals: `termpool` (its own
    processes, Redis apart), `docker` (daemons, shims, runc) and `other` (the machine minus
    every group named: runc processes too short to sample, other users of the machine)."""
    if not cpu or not episodes:
        return {}
    seconds = dict(cpu["cpu_s"])
    seconds["termpool"] = sum(seconds.get(k, 0.0) for k in TERMPOOL_KINDS)
    seconds["docker"] = sum(seconds.get(k, 0.0) for k in DOCKER_KINDS)
    named = sum(seconds.get(k, 0.0) for k in ("termpool", "docker", "redis", "containers", "bench"))
    seconds["other"] = seconds.get("machine", 0.0) - named
    return {k: round(v / episodes, 4) for k, v in seconds.items()}


def _cpu_medians(reps: list[dict]) -> dict:
    per_repeat = [cpu_per_episode(r.get("cpu"), r["episodes"]) for r in reps]
    per_repeat = [r for r in per_repeat if r]
    keys = sorted({k for r in per_repeat for k in r})
    return {
        "median": {k: median_value([r.get(k, 0.0) for r in per_repeat]) for k in keys},
        "repeats": per_repeat,
        "window_s": [(r.get("cpu") or {}).get("wall_s") for r in reps],
    }


def _warm_pool(reps: list[dict]) -> dict | None:
    """The warm pool's work per measurement (bench/warm.py): medians over repeats, and each."""
    per_repeat = [r["warm_pool"] for r in reps if r.get("warm_pool")]
    if not per_repeat:
        return None
    keys = [k for k in per_repeat[0] if all(r.get(k) is not None for r in per_repeat)]
    return {"median": {k: median_value([r[k] for r in per_repeat]) for k in keys}, "repeats": per_repeat}


def summarize_run(raw: dict, monitor, levels: list[int]) -> dict:
    out_levels: dict = {}
    operations: dict = {}
    errors = {"count": 0, "first": []}  # termpool's faces: these fail the run
    floor_errors = {"count": 0, "first": []}  # the raw SDK's own failures: reported only
    for level in levels:
        if level not in raw:
            continue
        faces = raw[level]
        entry: dict = {"concurrency": level}
        for face, reps in faces.items():
            per_repeat = {op: [summarize(r["samples"].get(op, [])) for r in reps] for op in FACE_OPS[face]}
            ops = {op: median_of(sums) for op, sums in per_repeat.items()}
            messages = [m for r in reps for m in r["error_messages"]]
            count = sum(r["error_count"] for r in reps)
            entry[face] = {
                "ops": ops,
                "episodes": sum(r["episodes"] for r in reps),
                "episodes_failed": sum(r["episodes_failed"] for r in reps),
                "episodes_per_s": median_value([r["episodes_per_s"] for r in reps]),
                "episodes_per_s_repeats": [r["episodes_per_s"] for r in reps],
                "wall_s": [r["wall_s"] for r in reps],
                "errors": {"count": count, "first": messages[:5]},
                "leaked": sorted({name for r in reps for name in r["leaked"]}),
                "drain_s": [r["drain_s"] for r in reps],
                "peak_live_runs": max((r["memory"]["live_runs"] for r in reps), default=0),
                "peak_rss_mb": max((r["memory"]["total_mb"] for r in reps), default=0.0),
                "cpu_per_episode": _cpu_medians(reps),
                "warm_pool": _warm_pool(reps),
            }
            bucket = floor_errors if face == "floor" else errors
            bucket["count"] += count
            bucket["first"] += [f"c={level} {m}" for m in messages][: max(0, 10 - len(bucket["first"]))]
            for op, stats in ops.items():
                operations.setdefault(face, {}).setdefault(op, {})[str(level)] = {
                    k: stats[k] for k in ("p50", "p95", "max", "mean", "n")
                }
        ratios: dict = {}
        floor_reps = faces.get("floor", [])
        for face, pairs in PAIRS.items():
            if face not in faces or not floor_reps:
                continue
            ratios[face] = {}
            for name, op, floor_op, how in pairs:
                per_repeat = []
                for mine, base in zip(faces[face], floor_reps):
                    a, b = summarize(mine["samples"].get(op, [])), summarize(base["samples"].get(floor_op, []))
                    per_repeat.append({k: _compare(a[k], b[k], how) for k in ("p50", "p95")})
                ratios[face][name] = {
                    "p50": median_value([r["p50"] for r in per_repeat]),
                    "p95": median_value([r["p95"] for r in per_repeat]),
                    "repeats": per_repeat,
                }
        entry["ratios"] = ratios
        phases = [r["phase"] for reps in faces.values() for r in reps]
        entry["memory"] = monitor.peak_over(phases) if monitor else {}
        out_levels[str(level)] = entry
    return {
        "levels": out_levels,
        "operations": operations,
        "errors": errors,
        "floor_errors": floor_errors,
        "memory": {
            "interval_s": monitor.interval if monitor else None,
            "samples": monitor.samples if monitor else 0,
            "peak_whole_run": monitor.peak("all") if monitor else {},
        },
    }


# ---- issue 4's targets ----------------------------------------------------------------------
def _level(result: dict, level: int) -> dict | None:
    return result.get("levels", {}).get(str(level))


def _ratio(result: dict, level: int, face: str, name: str, stat: str):
    entry = _level(result, level)
    return ((entry or {}).get("ratios", {}).get(face, {}).get(name) or {}).get(stat)


def _target(text: str, face: str, value, limit: float, met, note: str = "") -> dict:
    return {"target": text, "face": face, "value": value, "limit": limit, "met": met, "note": note}


def targets(result: dict) -> list[dict]:
    """Issue 4's targets, checked against this run (informational: never the exit status)."""
    out = []
    warm = result.get("config", {}).get("warm_pool_size", 0)
    for face, reset in (("pool", "reset/create_start"), ("runs", "start/create_start")):
        if not any(face in entry for entry in result.get("levels", {}).values()):
            continue
        v = _ratio(result, 1, face, "tool_call/exec", "p50")
        out.append(
            _target(
                "sequential (c=1) tool call p50 <= raw exec_run p50 (aim 0.5x): ratio",
                face,
                v,
                1.0,
                None if v is None else v <= 1.0,
                "aim 0.5",
            )
        )
        v = _ratio(result, 8, face, "tool_call/exec", "p95")
        out.append(
            _target(
                "c=8 tool call p95 within 1.5x of the floor's exec p95: ratio",
                face,
                v,
                1.5,
                None if v is None else v <= 1.5,
            )
        )
        v = _ratio(result, 1, face, reset, "p50")
        out.append(
            _target(
                f"c=1 {reset.split('/')[0]} p50 within 2x of raw create+start p50: ratio",
                face,
                v,
                2.0,
                None if v is None else v <= 2.0,
                "runs API start includes what allocate does" if face == "runs" else "",
            )
        )
        if face == "pool":
            for level, limit in ((1, 50.0), (8, 100.0)):
                entry = _level(result, level)
                v = entry["pool"]["ops"]["reset"]["p50"] if entry and "pool" in entry else None
                out.append(
                    _target(
                        f"with the warm pool c={level} reset p50 < {limit:g} ms",
                        face,
                        v,
                        limit,
                        None if v is None else v < limit,
                        f"WARM_POOL_SIZE={warm}" if warm else "WARM_POOL_SIZE=0: these are cold resets",
                    )
                )
        v = _ratio(result, 1, face, "evaluate-test_script_ms", "p50")
        out.append(
            _target(
                "c=1 evaluate p50 at most 250 ms above the test script's own p50: ms",
                face,
                v,
                250.0,
                None if v is None else v <= 250.0,
            )
        )
        entry = _level(result, 128)
        if entry and face in entry:
            errs, leaked = entry[face]["errors"]["count"], len(entry[face]["leaked"])
            out.append(
                _target(
                    "128 concurrent episodes with no error and no leaked container: errors+leaks",
                    face,
                    errs + leaked,
                    0,
                    errs + leaked == 0,
                    f"{errs} errors, {leaked} leaked; peak live runs seen by /status "
                    f"(sampled every 0.5 s): {entry[face]['peak_live_runs']}",
                )
            )
        else:
            out.append(
                _target(
                    "128 concurrent episodes with no error and no leaked container",
                    face,
                    None,
                    0,
                    None,
                    "concurrency 128 was not measured in this run",
                )
            )
    levels = result.get("levels", {})
    if levels:
        top = max(levels, key=int)
        v = levels[top].get("memory", {}).get("total_mb")
        out.append(
            _target(
                f"termpool's processes under 1.5 GiB together (peak summed RSS at c={top}): MB",
                "all",
                v,
                MEMORY_LIMIT_MB,
                None if v is None else v < MEMORY_LIMIT_MB,
                "" if top == "128" else "concurrency 128 was not measured in this run",
            )
        )
    return out


# ---- text -----------------------------------------------------------------------------------
ROWS = [
    ("reset / start", "reset", "start", "create_start", "reset/create_start", "start/create_start"),
    ("tool_call", "tool_call", "tool_call", "exec", "tool_call/exec", "tool_call/exec"),
    ("write_file", "write_file", "write_file", "put_archive", "write_file/put_archive", "write_file/put_archive"),
    ("evaluate", "evaluate", "evaluate", "test_script", "evaluate-test_script_ms", "evaluate-test_script_ms"),
    ("allocate", "allocate", None, None, None, None),
    ("heartbeat", "heartbeat", None, None, None, None),
    ("close", "close", "close", "remove", None, None),
    ("(floor only)", None, None, "copy_tests", None, None),
]


def _fmt(stats: dict | None) -> str:
    if not stats or stats.get("p50") is None:
        return "-"
    return f"{stats['p50']:.0f} / {stats['p95']:.0f} / {stats['max']:.0f}"


def _fmt_cmp(cmp: dict | None, name: str | None) -> str:
    if not cmp or cmp.get("p50") is None:
        return "-"
    if name and name.endswith("_ms"):
        return f"{cmp['p50']:+.0f} ms ({cmp['p95']:+.0f})"
    return f"{cmp['p50']:.2f}x ({cmp['p95']:.2f}x)"


def table(result: dict) -> str:
    """Markdown: per concurrency level, p50 / p95 / max in ms (medians over repeats)."""
    lines = []
    cfg = result.get("config", {})
    lines.append(
        f"termpool benchmark, {result.get('started_at')}: concurrency {cfg.get('concurrency')}, "
        f"{cfg.get('repeats')} repeats, {cfg.get('tool_calls')} tool calls per episode; "
        f"figures are medians over repeats of p50 / p95 / max in ms"
    )
    for level, entry in sorted(result.get("levels", {}).items(), key=lambda kv: int(kv[0])):
        lines += [
            "",
            f"### concurrency {level}",
            "",
            "| operation | pool API | runs API | floor op | floor | pool vs floor p50 (p95) | runs vs floor p50 (p95) |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, pop, rop, fop, pcmp, rcmp in ROWS:
            pool = entry.get("pool", {}).get("ops", {}).get(pop) if pop else None
            runs = entry.get("runs", {}).get("ops", {}).get(rop) if rop else None
            floor = entry.get("floor", {}).get("ops", {}).get(fop) if fop else None
            pc = entry.get("ratios", {}).get("pool", {}).get(pcmp) if pcmp else None
            rc = entry.get("ratios", {}).get("runs", {}).get(rcmp) if rcmp else None
            lines.append(
                f"| {label} | {_fmt(pool)} | {_fmt(runs)} | {fop or '-'} | {_fmt(floor)} | "
                f"{_fmt_cmp(pc, pcmp)} | {_fmt_cmp(rc, rcmp)} |"
            )
        eps = " | ".join(f"{entry[f]['episodes_per_s']}" if f in entry else "-" for f in ("pool", "runs"))
        lines.append(f"| episodes/s | {eps} | | {entry['floor']['episodes_per_s'] if 'floor' in entry else '-'} | | |")
        errs = " | ".join(
            f"{entry[f]['errors']['count']} / {len(entry[f]['leaked'])}" if f in entry else "-"
            for f in ("pool", "runs")
        )
        lines.append(
            f"| errors / leaked | {errs} | | {entry['floor']['errors']['count'] if 'floor' in entry else '-'} | | |"
        )
        mem = entry.get("memory", {})
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in mem.get("by_kind_mb", {}).items())
        lines.append("")
        lines.append(
            f"peak RSS of termpool's processes at this level: {mem.get('total_mb', 0):.0f} MB ({kinds}); "
            f"peak live runs (/status, sampled): {mem.get('live_runs')}"
        )
        lines += warm_pool_lines(entry)
    lines += cpu_table(result)
    lines += ["", "### targets", "", "| target | face | value | limit | met |", "|---|---|---|---|---|"]
    for t in result.get("targets", []):
        met = {True: "yes", False: "NO", None: "n/a"}[t["met"]]
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"| {t['target']}{note} | {t['face']} | {t['value']} | {t['limit']} | {met} |")
    errors, floor_errors = result.get("errors", {}), result.get("floor_errors", {})
    lines += [
        "",
        f"termpool errors: {errors.get('count_with_warmup')} "
        f"(first: {(result.get('warmup_errors', {}).get('first', []) + errors.get('first', []))[:3]}); "
        f"leaked containers: {len(result.get('leaked_containers', []))}; "
        f"floor (raw SDK) errors, not counted against termpool: {floor_errors.get('count')} "
        f"(first: {floor_errors.get('first', [])[:3]}); runs API: {result.get('runs_api')}",
    ]
    return "\n".join(lines)


def warm_pool_lines(entry: dict) -> list[str]:
    """The warm pool's work at one level (medians over repeats), per termpool face."""
    lines = []
    for face in ("pool", "runs"):
        median = ((entry.get(face) or {}).get("warm_pool") or {}).get("median")
        if median:
            lines.append(
                f"warm pool during the {face} API measurement: {median.get('claimed', 0):.0f} resets served from "
                f"it, {median.get('missed', 0):.0f} missed; {median.get('started', 0):.0f} spares started "
                f"({median.get('start_s', 0):.1f} s of starts, {median.get('cpu_s', 0):.2f} CPU-s in the "
                f"lifecycle worker), {median.get('trimmed', 0):.0f} trimmed, {median.get('expired', 0):.0f} "
                f"expired; {median.get('spares_at_end', 0):.0f} spares at the end using "
                f"{median.get('spares_memory_mb', 0):.0f} MB"
            )
    return [""] + lines if lines else []


def cpu_table(result: dict) -> list[str]:
    """CPU-seconds per episode by process group, per level and face (medians over repeats)."""
    lines = [
        "",
        "### CPU-seconds per episode",
        "",
        "Medians over repeats, from /proc over each measurement (termpool faces: until every "
        "teardown finished). termpool = its own processes (Redis apart); docker = dockerd, "
        "containerd, containerd-shim*, runc (shims and runc sampled: a lower bound); containers = "
        "every container's cgroup on the machine (other users' too); other = the machine minus "
        "the named groups (other users' processes, runc too short-lived to sample).",
        "",
        "| c | face | " + " | ".join(CPU_COLUMNS) + " |",
        "|---|---|" + "---|" * len(CPU_COLUMNS),
    ]
    for level, entry in sorted(result.get("levels", {}).items(), key=lambda kv: int(kv[0])):
        for face in ("pool", "runs", "floor"):
            median = (entry.get(face) or {}).get("cpu_per_episode", {}).get("median")
            if not median:
                continue
            cells = ["-" if median.get(k) is None else f"{median[k]:.3f}" for k in CPU_COLUMNS]
            lines.append(f"| {level} | {face} | " + " | ".join(cells) + " |")
    return lines + stack_floor_lines(result)


def stack_floor_lines(result: dict) -> list[str]:
    """termpool's own CPU per episode against the minimal Flask + Celery stack's (--stack-floor)."""
    floor = result.get("stack_floor") or {}
    if not floor.get("levels"):
        return ["", f"stack floor not measured: {floor['error']}"] if floor.get("error") else []
    lines = [
        "",
        "### termpool against the stack floor",
        "",
        f"The same episodes (16 requests, 14 jobs each) on a Flask + gunicorn + Celery + Redis service "
        f"that does nothing else (bench/stack_floor.py), {'with' if floor['flower'] else 'without'} Flower, "
        f"measured after termpool in this run; medians of {floor['repeats']} repeats of {floor['episodes']} "
        "episodes. CPU-seconds per episode, Redis apart.",
        "",
        "| c | termpool (pool API) | stack floor | termpool / floor | floor facade | floor worker | floor flower |",
        "|---|---|---|---|---|---|---|",
    ]
    for level, figures in sorted(floor["levels"].items(), key=lambda kv: int(kv[0])):
        cpu = figures["cpu_s_per_episode"]
        entry = result.get("levels", {}).get(level) or result.get("levels", {}).get(str(level)) or {}
        ours = ((entry.get("pool") or {}).get("cpu_per_episode") or {}).get("median", {}).get("termpool")
        ratio = f"{ours / cpu['stack']:.2f}x" if ours and cpu["stack"] else "-"
        lines.append(
            f"| {level} | {'-' if ours is None else f'{ours:.3f}'} | {cpu['stack']:.3f} | {ratio} | "
            f"{cpu['facade']:.3f} | {cpu['worker']:.3f} | {cpu['flower']:.3f} |"
        )
    return lines
