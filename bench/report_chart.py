"""The benchmark's PNG chart: latency per operation and level for each face (bench/report.py
makes the figures it draws)."""

from __future__ import annotations

import math
from pathlib import Path

PANELS = [
    (
        "reset (pool) / start (runs) vs create+start",
        [
            ("pool reset", "pool", "reset"),
            ("runs start", "runs", "start"),
            ("floor create+start", "floor", "create_start"),
        ],
    ),
    (
        "tool call (echo hi) vs exec_run",
        [
            ("pool tool_call", "pool", "tool_call"),
            ("runs tool_call", "runs", "tool_call"),
            ("floor exec_run", "floor", "exec"),
        ],
    ),
    (
        "write file vs put_archive",
        [
            ("pool write_file", "pool", "write_file"),
            ("runs write_file", "runs", "write_file"),
            ("floor put_archive", "floor", "put_archive"),
        ],
    ),
    (
        "evaluate vs the test script",
        [
            ("pool evaluate", "pool", "evaluate"),
            ("runs evaluate", "runs", "evaluate"),
            ("floor test script", "floor", "test_script"),
        ],
    ),
    (
        "allocate, heartbeat, close vs remove",
        [
            ("pool allocate", "pool", "allocate"),
            ("pool heartbeat", "pool", "heartbeat"),
            ("pool close", "pool", "close"),
            ("runs close", "runs", "close"),
            ("floor remove", "floor", "remove"),
        ],
    ),
]
PALETTE = {"pool": ["#1f77b4", "#9467bd"], "runs": ["#2ca02c", "#bcbd22"], "floor": ["#7f7f7f"]}


def chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(result.get("levels", {}), key=int)
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    for ax, (title, series) in zip(axes.flat, PANELS):
        series = [s for s in series if any(s[1] in result["levels"][lv] for lv in levels)]
        width = 0.8 / max(1, len(series))
        for i, (label, face, op) in enumerate(series):
            xs, p50, p95 = [], [], []
            for j, lv in enumerate(levels):
                stats = result["levels"][lv].get(face, {}).get("ops", {}).get(op)
                if stats and stats.get("p50") is not None:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    p50.append(stats["p50"])
                    p95.append(stats["p95"])
            nth = sum(1 for s in series[:i] if s[1] == face)
            color = PALETTE[face][nth % len(PALETTE[face])]
            ax.bar(xs, p95, width * 0.9, color=color, alpha=0.3, edgecolor=color, hatch="//", label=f"{label} p95")
            ax.bar(xs, p50, width * 0.9, color=color, alpha=0.95, label=f"{label} p50")
        ax.set_title(title)
        ax.set_xticks(range(len(levels)), [f"c={lv}" for lv in levels])
        ax.set_yscale("log")
        values = [
            v
            for lv in levels
            for _, face, op in series
            for v in [(result["levels"][lv].get(face, {}).get("ops", {}).get(op) or {}).get(k) for k in ("p50", "p95")]
            if v
        ]
        if values:  # bars start a decade below the smallest value; room above for the legend
            ax.set_ylim(10 ** math.floor(math.log10(min(values)) - 0.3), max(values) * 6)
        ax.set_ylabel("ms (log)")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper left", framealpha=0.8)
    ax = axes.flat[5]
    faces = [f for f in ("pool", "runs", "floor") if any(f in result["levels"][lv] for lv in levels)]
    width = 0.8 / max(1, len(faces))
    for i, face in enumerate(faces):
        xs, ys = [], []
        for j, lv in enumerate(levels):
            value = result["levels"][lv].get(face, {}).get("episodes_per_s")
            if value is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(value)
        ax.bar(xs, ys, width * 0.9, color=PALETTE[face][0], label=face)
    ax.set_title("whole episodes per second")
    ax.set_xticks(range(len(levels)), [f"c={lv}" for lv in levels])
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    cfg = result.get("config", {})
    fig.suptitle(
        f"termpool vs raw Docker SDK (floor), {result.get('started_at')}: medians of {cfg.get('repeats')} "
        f"repeats, {cfg.get('tool_calls')} tool calls/episode, {result.get('machine', {}).get('cpus')} cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
