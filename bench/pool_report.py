"""bench/pool_builds.py's tables (markdown) from its result: the summary with the issue's figures,
then one row per task."""

from __future__ import annotations

import statistics


def base(task: str) -> str:
    """The source task's name of a copy (<task>-<run suffix>)."""
    return task.rsplit("-", 1)[0]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def by_task(rows: list[dict], status: str | None = None) -> dict[str, dict]:
    return {base(r["task"]): r for r in rows if status is None or r["status"] == status}


def reset_figures(rows: list[dict]) -> dict:
    """Medians over the host's tasks: first resets by where the image came from, warm resets."""
    out = {}
    for source in ("pulled", "present"):
        firsts = [r["first_s"] for r in rows if r.get("source") == source]
        out[f"first_{source}"] = (median(firsts), len(firsts))
    out["built_at_reset"] = sum(r.get("source") == "built" for r in rows)
    out["warm"] = median(r["warm_median_s"] for r in rows)
    out["failed"] = sum("error" in r for r in rows)
    return out


def summary(result: dict) -> list[str]:
    single, pool, join, hosts = result["single"], result["pool"], result["join"], result["hosts"]
    built = [r for r in pool["rows"] if r["status"] == "built"]
    envs = pool["images"]["distinct_environments"]
    lines = [
        "| figure | value |",
        "|---|---|",
        f"| tasks (distinct environments) | {len(result['tasks'])} ({envs}) |",
        f"| one host builds all (A, no registry): wall s | {single['wall_s']} ({single['counts']['built']} built) |",
        f"| pool prebuild on A+B, cold registry: wall s | {pool['wall_s']} "
        f"({ratio(pool['wall_s'], single['wall_s'])} of one host) |",
        f"| the same prebuild again, every image present (the CLI's floor): wall s | "
        f"{result['prebuild_noop']['wall_s']} |",
        f"| pool prebuild rows built / pulled / present / failed | {pool['counts']['built']} / "
        f"{pool['counts']['pulled']} / {pool['counts']['present']} / {pool['counts']['failed']} "
        f"(target: {envs} built) |",
        f"| next dataset version on A+B (new digests, registry holds the base): wall s, rows built | "
        f"{result['update']['wall_s']} ({ratio(result['update']['wall_s'], single['wall_s'])} of one host), "
        f"{result['update']['counts']['built']} built, {result['update']['images']['builds']} image ids |",
        f"| builds on A / B | {sum(r['host'] == hosts['A'] for r in built)} / "
        f"{sum(r['host'] == hosts['B'] for r in built)} |",
        f"| builds in the pool (distinct image ids: after prebuild, resets, C's join) | "
        f"{pool['images']['builds']}, {result['after_resets']['builds']}, {result['after_join']['builds']} |",
        f"| build s per environment, one host / pool (build+push), median | "
        f"{median(r['seconds'] for r in single['rows'])} / {median(r['seconds'] for r in built)} |",
    ]
    for letter, rows in (*result["resets"].items(), ("C", join["resets"])):
        fig = reset_figures(rows)
        (pulled, n_pulled), (present, n_present) = fig["first_pulled"], fig["first_present"]
        lines.append(
            f"| host {letter} first reset s, pulled at reset (n) / image present (n) / warm, medians | "
            f"{pulled} ({n_pulled}) / {present} ({n_present}) / {fig['warm']}"
            f"{'; built at reset: ' + str(fig['built_at_reset']) if fig['built_at_reset'] else ''}"
            f"{'; failed: ' + str(fig['failed']) if fig['failed'] else ''} |"
        )
    lines += [
        f"| C joins: workers start -> serving s | {join['to_serving_s']} |",
        f"| C joins: -> every task present (prebuild --hosts all {join['prebuild_all']['wall_s']} s) | "
        f"{join['to_every_task_present_s']} s ({join['tasks_present']} tasks, pulled not built: "
        f"{join['pulled_not_built']}) |",
    ]
    return lines + disk_lines(result)


def disk_lines(result: dict) -> list[str]:
    before, mid, after = result["disk_before"], result["disk_after_prebuild"], result["disk_after"]
    lines = [
        f"| registry storage MB: before / after prebuild / at the end | {before['registry_mb']} / "
        f"{mid['registry_mb']} / {after['registry_mb']} |"
    ]
    for letter in ("A", "B", "C"):
        b, a = before[letter], after[letter]
        lines.append(
            f"| host {letter} image disk MB (all layers): before / after; this run's images above the base | "
            f"{b['layers_mb']} / {a['layers_mb']}; {a['bench_images']} images, {a['bench_above_base_kb']} kB |"
        )
    return lines


def per_task(result: dict) -> list[str]:
    """One row per task: its environment, where the pool built it, its build times, and each
    host's first reset (where the image came from) and warm reset."""
    single, pool = by_task(result["single"]["rows"]), by_task(result["pool"]["rows"])
    hosts = {host: letter for letter, host in result["hosts"].items()}
    content = {base(t): c for t, c in result["pool"]["images"]["content"].items()}
    resets = {letter: {base(r["task"]): r for r in rows} for letter, rows in result["resets"].items()}
    resets["C"] = {base(r["task"]): r for r in result["join"]["resets"]}
    head = "| task | environment | pool prebuild | one host build s | " + " | ".join(
        f"{x} first s (image) | {x} warm s" for x in resets
    )
    lines = [head + " |", "|---" * (4 + 2 * len(resets)) + "|"]
    for task in (base(t) for t in result["tasks_run"]):
        row = pool.get(task, {})
        cells = [
            task,
            content.get(task, ""),
            f"{row.get('status', '-')} on {hosts.get(row.get('host'), '?')} {row.get('seconds', '-')} s",
            str(single.get(task, {}).get("seconds", "-")),
        ]
        for letter in resets:
            r = resets[letter].get(task, {})
            cells += [
                f"{r.get('first_s')} ({r.get('source') or r.get('error', '-')[:30]})",
                str(r.get("warm_median_s")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table(result: dict) -> str:
    if "join" not in result:
        return "incomplete run: " + "; ".join(result.get("failures", []))
    return "\n".join([*summary(result), "", *per_task(result)]) + "\n"
