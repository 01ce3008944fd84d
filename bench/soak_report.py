"""The soak's verdicts: each sampled figure as a series over episodes, its least-squares slope
per thousand episodes after warm-up, whether it grows, and whether it is back to its start
once the pool has been idle past the TTLs; and the markdown table of them.

A series *grows* when its fitted rise over the fitted window is both clear of the noise (the
slope at least 3 standard errors above zero) and material (more than 5 % of its mean and more
than its unit's floor: 1 MB, 1 key, 1 object). It is *back* when its idle value is at most its
start's plus the same allowance.
"""

from __future__ import annotations

import math

WARMUP_SHARE = 0.2  # samples before this share of the episodes are warm-up, left out of the fit
MIN_T = 3.0
MIN_SHARE = 0.05


def flatten(sample: dict) -> dict[str, float]:
    """One sample as {series name: value}."""
    out = {"redis used_memory_mb": sample["redis"]["used_memory_mb"], "redis keys": sample["redis"]["keys"]}
    out["pending closes"] = sample["redis"].get("pending_closes", 0)
    out.update({f"queued {kind}": n for kind, n in sample["redis"].get("queued", {}).items()})
    out.update({f"redis keys {fam}": n for fam, n in sample["redis"]["keys_by_family"].items()})
    out.update({f"rss_mb {kind}": mb for kind, mb in sample["rss_mb"].items()})
    out.update({f"fds {kind}": n for kind, n in sample["fds"].items()})
    out.update({f"docker {name}": n for name, n in sample["docker"].items()})
    for name, figures in sample["disk"].items():
        out.update({f"disk {name} {unit}": v for unit, v in figures.items()})
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys over xs and its standard error (inf with fewer than 3 points)."""
    n = len(xs)
    if n < 2:
        return 0.0, math.inf
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, math.inf
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n < 3:
        return slope, math.inf
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(residual / (n - 2) / sxx)


def allowance(level: float) -> float:
    """What a series may move without counting: 5 % of its level, and at least one unit (1 MB
    for a series in MB; else 1 key, object, descriptor or entry)."""
    return max(1.0, MIN_SHARE * abs(level))


def verdict(name: str, points: list[tuple[int, float]], total: int, start: float, idle: float | None) -> dict:
    fitted = [(x, y) for x, y in points if x >= WARMUP_SHARE * total]
    xs, ys = [x for x, _ in fitted], [y for _, y in fitted]
    slope, error = fit(xs, ys)
    mean = sum(ys) / len(ys) if ys else 0.0
    rise = slope * (max(xs) - min(xs)) if xs else 0.0
    # A perfect line (no residual): any rise is clear of the noise.
    clear = slope > 0 if error == 0 else not math.isinf(error) and slope / error >= MIN_T
    grows = clear and rise > allowance(mean)
    return {
        "series": name,
        "start": start,
        "end": points[-1][1] if points else None,
        "idle": idle,
        "slope_per_1000": round(slope * 1000, 3),
        "slope_stderr_per_1000": None if math.isinf(error) else round(error * 1000, 3),
        "verdict": "grows" if grows else "flat",
        "back_to_start": None if idle is None else idle <= start + allowance(start),
    }


def analyse(samples: list[dict]) -> list[dict]:
    """Verdicts for every series of the samples of phase "soak" (episodes > 0 or the start) and
    the last "idle" one."""
    soak = [s for s in samples if s["phase"] in ("start", "soak")]
    idle = [s for s in samples if s["phase"] == "idle"]
    flat = [(s["episodes"], flatten(s)) for s in soak]
    idle_values = flatten(idle[-1]) if idle else None
    names = sorted({name for _, values in flat for name in values} | set(idle_values or {}))
    total = max(x for x, _ in flat)
    out = []
    for name in names:
        points = [(x, values.get(name, 0.0)) for x, values in flat]
        idle_value = None if idle_values is None else idle_values.get(name, 0.0)
        out.append(verdict(name, points, total, points[0][1], idle_value))
    return out


def markdown(verdicts: list[dict], samples: list[dict]) -> str:
    lines = [
        "| series | start | end | idle | slope / 1000 ep (± s.e.) | verdict | back to start |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        error = "" if v["slope_stderr_per_1000"] is None else f" ± {v['slope_stderr_per_1000']:g}"
        back = {None: "-", True: "yes", False: "**no**"}[v["back_to_start"]]
        grows = "**grows**" if v["verdict"] == "grows" else "flat"
        idle = "-" if v["idle"] is None else f"{v['idle']:g}"
        lines.append(
            f"| {v['series']} | {v['start']:g} | {v['end']:g} | {idle} | {v['slope_per_1000']:g}{error} | {grows} | {back} |"
        )
    return "\n".join(lines) + "\n\n" + trajectory(samples)


def trajectory(samples: list[dict]) -> str:
    """The headline series at every sample."""
    heads = ["redis used_memory_mb", "redis keys", "pending closes", "queued teardown", "docker containers"]
    heads += ["docker networks", "docker task_images"]
    heads += ["disk output mb", "disk output entries", "disk logs mb", "disk sockets entries"]
    lines = ["| phase | episodes | " + " | ".join(heads) + " | RSS sum MB | fds sum |"]
    lines.append("|" + "---|" * (len(heads) + 4))
    for sample in samples:
        values = flatten(sample)
        cells = [f"{values.get(h, 0):g}" for h in heads]
        rss, fds = round(sum(sample["rss_mb"].values()), 1), sum(sample["fds"].values())
        lines.append(f"| {sample['phase']} | {sample['episodes']} | " + " | ".join(cells) + f" | {rss:g} | {fds} |")
    return "\n".join(lines) + "\n"
