"""The benchmark harness's smoke run (bench/README.md): `python -m bench.run --quick` starts its
own stack, drives whole episodes through both HTTP faces and the raw Docker SDK at concurrency
1 and 8, and must finish with no error and no leaked container; with --stack-floor it measures
the same episodes on the minimal Flask + Celery stack too. Timings are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.episodes import FLOOR_OPS, POOL_OPS, RUNS_OPS
from devstack import ROOT


def _runs_api_has_routes() -> bool:
    """The runs API counts as present once its blueprint defines routes (docs/http-api.md section 2)."""
    from app.runs_api import bp

    return bool(bp.deferred_functions)


def _assert_stats(stats: dict, where: str) -> None:
    assert stats["n"] > 0, f"{where}: no sample"
    for key in ("p50", "p95", "max"):
        assert isinstance(stats[key], (int, float)) and stats[key] >= 0, f"{where}: {key} = {stats[key]!r}"
    assert stats["p50"] <= stats["p95"] <= stats["max"], f"{where}: {stats}"


def test_bench_quick_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--stack-floor", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    result = json.loads((tmp_path / "latest.json").read_text())
    assert result["exit_code"] == 0
    assert result["errors"]["count_with_warmup"] == 0, result["errors"]
    assert result["leaked_containers"] == []
    assert sorted(result["levels"], key=int) == ["1", "8"]

    faces = {"pool": POOL_OPS, "floor": FLOOR_OPS}
    if _runs_api_has_routes():
        assert result["runs_api"]["available"] is True, result["runs_api"]
        faces["runs"] = RUNS_OPS
    for level, entry in result["levels"].items():
        for face, ops in faces.items():
            assert entry[face]["episodes"] > 0, (level, face)
            if face != "floor":  # the raw SDK's own hiccups are reported, not termpool's failure
                assert entry[face]["episodes_failed"] == 0, (level, face, entry[face]["errors"])
            assert entry[face]["episodes_per_s"] > 0
            for op in ops:
                _assert_stats(entry[face]["ops"][op], f"c={level} {face} {op}")
        for face in faces:
            if face != "floor":
                for name, cmp in entry["ratios"][face].items():
                    assert cmp["p50"] is not None, (level, face, name)
        memory = entry["memory"]
        assert memory["total_mb"] > 0 and {"facade", "redis", "exec", "lifecycle"} <= set(memory["by_kind_mb"])

    floor = result["stack_floor"]
    assert sorted(floor["levels"], key=int) == ["1", "8"], floor
    for level, figures in floor["levels"].items():
        assert figures["errors"] == 0 and figures["episodes"] >= 32, (level, figures)
        cpu = figures["cpu_s_per_episode"]
        # Each figure is rounded to 4 decimals on its own: their sum may pass the rounded total by 1e-4.
        assert cpu["facade"] > 0 and cpu["worker"] > 0 and cpu["stack"] >= cpu["facade"] + cpu["worker"] - 1e-4, cpu
        assert set(figures["p50_ms"]) == {
            "allocate",
            "reset",
            "heartbeat",
            "tool_call",
            "write_file",
            "evaluate",
            "close",
        }

    assert result["targets"], "the issue's targets are reported"
    assert (tmp_path / "latest.png").stat().st_size > 10_000
    text = (tmp_path / "latest.md").read_text()
    assert text.startswith("termpool benchmark") and "### termpool against the stack floor" in text


def test_stack_floor_alone(tmp_path):
    """`python -m bench.stack_floor` on its own (bench/README.md): figures, and a clear refusal
    of bad arguments."""
    out = tmp_path / "floor.json"
    argv = [sys.executable, "-m", "bench.stack_floor", "--concurrency", "1,2", "--repeats", "1", "--episodes", "4"]
    proc = subprocess.run([*argv, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    figures = json.loads(out.read_text())
    assert sorted(figures["levels"], key=int) == ["1", "2"] and figures["flower"] is False
    for level, entry in figures["levels"].items():
        assert entry["errors"] == 0 and entry["episodes"] == 4, (level, entry)
        assert entry["cpu_s_per_episode"]["facade"] > 0 and entry["cpu_s_per_episode"]["flower"] == 0
    assert "| 1 |" in proc.stdout and "| 2 |" in proc.stdout

    for bad in (["--concurrency", "x"], ["--concurrency", "0"], ["--repeats", "0"]):
        refused = subprocess.run([*argv, *bad], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "error:" in refused.stderr, (bad, refused.stderr)


def test_storm_small(tmp_path):
    """`python -m bench.storm` at tiny sizes (bench/README.md, docs/tenant-storm.md): both
    tenants' operations succeed, nothing is left behind, and the report has its figures and
    the breakdown of B's calls. Timings are not asserted."""
    argv = [sys.executable, "-m", "bench.storm", "--storm-runs", "3", "--storm-episodes", "2", "--b-episodes", "2"]
    argv += ["--b-tool-calls", "2", "--a-tool-calls", "2", "--think", "0,0.1", "--out", str(tmp_path)]
    argv += ["--b-nice", "-1"]  # B's client a step ahead (root here); A's storm process back at 0
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (written,) = tmp_path.glob("storm-*.json")
    result = json.loads(written.read_text())
    assert result["ok"] and result["failures"] == {} and result["left_behind"] == {}
    assert result["sizes"]["storm_runs"] == 3 and result["a"]["resets_at_once"] == 3
    assert result["a"]["held_reset_ms"]["n"] == 3 and result["a"]["loop_episodes"] >= 2
    for phase in ("b_alone", "b_storm"):
        b = result[phase]
        assert b["episodes_ok"] == 2 and b["episodes_failed"] == 0, b
        assert b["tool_call"]["n"] == 4 and b["reset"]["n"] == 2, b
        for op, calls in (("tool_call", 4), ("reset", 2)):
            waited = b["waited_on"][op]
            assert waited["n"] == calls, (phase, op, waited)
            assert {"client", "outside", "queue", "run"} <= set(waited), waited
    for name in ("tool_call_p50", "tool_call_p95", "reset_p50", "reset_p95"):
        assert result["storm_over_alone"][name] > 0, result["storm_over_alone"]
    assert set(result["targets"]) == {"tool_call_p50", "reset_p50"} and result["b_nice"] == -1

    refused = subprocess.run([*argv, "--storm-runs", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "error:" in refused.stderr, refused.stderr


def test_facade_small(tmp_path):
    """`python -m bench.facade` at tiny sizes (docs/performance.md): every operation at each
    concurrency has its figures and the bare stack's floor beside them, and the runs it reset
    are torn down before the stack stops. Timings are not asserted."""
    out = tmp_path / "facade.json"
    argv = [sys.executable, "-m", "bench.facade", "--calls", "3", "--repeats", "1", "--concurrency", "1,2"]
    proc = subprocess.run(
        [*argv, "--no-profile", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert set(result["levels"]) == {"1", "2"} and set(result["floor"]) == {"1", "2"}
    for ops in result["levels"].values():
        assert set(ops) == {"allocate", "heartbeat", "close", "exec_nonblocking", "view"}
        for figures in ops.values():
            assert figures["p50"] > 0 and figures["floor_p50"] > 0 and figures["vs_floor"] > 0, figures
    assert result["levels"]["1"]["close"]["reference_p50"] == 2.2
    assert "| x floor |" in proc.stdout
    assert "the stack left" not in proc.stderr, proc.stderr[-2000:]  # its runs closed, torn down
