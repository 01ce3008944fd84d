"""The chaos suite's harness keeps working: one cheap scenario end to end (the service started
by scripts/serve.sh, two episodes, the probe, leftovers, cleanup), and its pure parts.

The full suite is long and is run by hand: `python -m chaos.run` (see chaos/README.md and docs/faults.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import docker
import psutil
import pytest

from chaos import faults, report
from chaos.service import ROOT, role_of


def test_roles_are_read_from_command_lines():
    assert role_of(["python3", "-m", "tasks.worker", "build"]) == "build"
    assert role_of(["/usr/bin/python3", "-m", "tasks.worker", "beat"]) == "beat"
    assert role_of(["python3", "-m", "gunicorn", "-c", "app/gunicorn_conf.py", "app:create_app()"]) == "web"
    assert role_of(["/usr/local/bin/gunicorn", "app:create_app()"]) == "web"
    assert role_of(["python3", "-m", "tasks.flower"]) == "flower"
    # a shell wrapper carries the whole command in one argument: not the process itself
    assert role_of(["/bin/sh", "-c", "python3 -m tasks.worker build"]) is None
    assert role_of(["python3", "-m", "honcho", "start", "-f", "Procfile"]) is None


def test_table_names_failures_and_leftovers():
    result = {
        "scenario": "kill-exec",
        "fault": "kill -9 exec worker",
        "episodes": 4,
        "episodes_ok": 3,
        "runs_lost": 1,
        "refused": 0,
        "failed_by_code": {"WORKER_LOST (reset)": 1},
        "lost_tool_calls": 1,
        "requests": 30,
        "longest_request_s": 21.5,
        "longest_request_step": "reset",
        "requests_over_20s": 1,
        "recover_s": None,
        "service_exited": True,
        "not_running_after": ["serve.sh"],
        "leftovers": {"containers": ["a"], "slots_held": 2, "redis_locks": [], "processes": []},
    }
    row = report.table([result]).splitlines()[2]
    assert "| 3/4 | - / - | 1 | 0 |" in row and "1x WORKER_LOST (reset)" in row and "21.5 s (reset); 1 > 20 s" in row
    assert "never (service exited)" in row and "1 containers, 2 slots held" in row


def test_table_counts_failures_after_the_fault_ends():
    result = {
        "scenario": "restart-stack",
        "fault": "kill -9 whole stack + Redis, relaunch at once",
        "fault_detail": {"note": "/healthz 4.7 s, /readyz 11.3 s after relaunch"},
        "episodes": 8,
        "episodes_ok": 8,
        "runs_lost": 0,
        "refused": 0,
        "failed_by_code": {},
        "lost_tool_calls": 5,
        "requests": 80,
        "longest_request_s": 3.3,
        "longest_request_step": "write",
        "request_failures_by_code": {"ConnectError": 21, "WORKERS_DOWN": 2},
        "failed_after": "healthz",
        "failed_after_healthz_by_code": {"WORKERS_DOWN (reset)": 2},
        "last_failure_after_s": 1.5,
        "recover_s": 12.8,
        "not_running_after": [],
        "leftovers": {"packet_rules": ["-A INPUT ..."]},
    }
    row = report.table([result]).splitlines()[2]
    assert "relaunch at once (/healthz 4.7 s, /readyz 11.3 s after relaunch)" in row
    assert "21x ConnectError, 2x WORKERS_DOWN; after healthz: 2x WORKERS_DOWN (reset) (the last 1.5 s after)" in row
    assert row.endswith("| 1 packet-filter rules |")


def test_partition_drops_one_port_both_ways_on_loopback():
    rules = faults.partition_rules(41234, "chaos-partition-x")
    assert [rule[0] for rule in rules] == ["INPUT", "OUTPUT"]
    assert rules[0][rules[0].index("--dport") + 1] == "41234" and rules[0][rules[0].index("-i") + 1] == "lo"
    assert rules[1][rules[1].index("--sport") + 1] == "41234" and rules[1][rules[1].index("-o") + 1] == "lo"
    assert all(rule[-2:] == ["-j", "DROP"] and "chaos-partition-x" in rule for rule in rules)


def test_a_fault_is_undone_once_and_none_starts_after_the_end():
    undo, done = faults.Undo(), []
    handle = undo.apply(lambda: done.append("stop"), lambda: done.append("cont"))
    undo.undo(handle)
    undo.apply(lambda: done.append("drop"), lambda: done.append("accept"))
    undo.close()  # the scenario's finally: lifts what is still in place, once
    undo.undo(handle)
    with pytest.raises(RuntimeError):
        undo.apply(lambda: done.append("late"), lambda: None)
    assert done == ["stop", "cont", "drop", "accept"]


def test_busy_loops_are_killed_whatever_happens():
    with pytest.raises(KeyboardInterrupt), faults.busy_loops(2) as pids:
        assert all(psutil.Process(pid).is_running() for pid in pids)
        raise KeyboardInterrupt
    assert not any(psutil.pid_exists(pid) for pid in pids)


def run_chaos(tmp_path, scenario: str, episodes: int, timeout: float = 300, client="router") -> tuple[dict, str]:
    """One scenario through `python -m chaos.run`, two episodes at once: its JSON record and the table."""
    out = tmp_path / "chaos.json"
    argv = ["--scenarios", scenario, "--episodes", str(episodes), "--concurrency", "2", "--json", str(out)]
    argv += ["--client", client]
    proc = subprocess.run(
        [sys.executable, "-m", "chaos.run", *argv, "--logs", str(tmp_path / "logs")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["scenarios"][0]
    assert "error" not in result, result
    return result, proc.stdout


def test_baseline_scenario_runs_clean(tmp_path):
    result, table = run_chaos(tmp_path, "baseline", 2)
    assert "| baseline | none | 2/2 | 2 / 2 | 0 | 0 |" in table, table
    assert result["episodes_ok"] == 2 and result["requests"] == 16, result
    assert result["recover_s"] is not None and result["not_running_after"] == [], result
    assert result["leftover_count"] == 0, result["leftovers"]
    left = docker.from_env().containers.list(all=True, filters={"label": f"termpool.host={result['host_id']}"})
    assert left == []


def test_redis_at_maxmemory_answers_503_and_serves_again(tmp_path):
    """A full Redis: refused requests are 503 BACKEND_FULL (none 500, no hang), no worker is
    taken for dead, nothing is half-written, nothing is left, and it serves once lifted."""
    result, _ = run_chaos(tmp_path, "redis-maxmemory", 4)
    assert set(result["request_failures_by_code"]) <= {"BACKEND_FULL"}, result["request_failures_by_code"]
    assert result["runs_lost"] == 0 and result["refused"] == 0, result["failure_examples"]
    assert result["fault_detail"]["half_written"] == [], result["fault_detail"]
    assert result["requests_over_20s"] == 0 and result["recover_s"] is not None, result
    assert result["leftover_count"] == 0, result["leftovers"]


def test_docker_restart_fails_lost_runs_with_a_retryable_code(tmp_path):
    """The second Docker daemon restarted under live runs: their calls answer CONTAINER_LOST
    (BACKEND_UNAVAILABLE while it is down), none waits 20 s, nothing is left, and a new
    episode succeeds once it is back."""
    result, _ = run_chaos(tmp_path, "docker-restart", 4, timeout=600)
    assert set(result["request_failures_by_code"]) <= {"CONTAINER_LOST", "BACKEND_UNAVAILABLE"}, result
    assert set(result["failed_by_code"]) <= {f"CONTAINER_LOST ({step})" for step in ("reset", "write", "evaluate")}
    assert result["requests_over_20s"] == 0 and result["recover_s"] is not None, result
    assert result["leftover_count"] == 0, result["leftovers"]


def test_a_redis_partition_costs_no_call(tmp_path):
    """Redis's port dropped both ways for 10 s while an evaluation runs: the calls in flight
    wait for it and finish; every episode whole without a single retry, nothing left."""
    result, _ = run_chaos(tmp_path, "redis-partition", 4, timeout=600, client="seed")
    assert "evaluation" in result["fault_detail"]["in_flight"], result["fault_detail"]
    assert result["episodes_whole_without_retries"] == 4, result["failure_examples"]
    assert result["request_failures_by_code"] == {} and result["step_retries"] == 0, result
    assert result["leftover_count"] == 0, result["leftovers"]


def test_a_docker_restart_with_live_restore_costs_no_call(tmp_path):
    """The second daemon, with live-restore, restarted while a reset and an evaluation run:
    the runs' containers keep running, the calls in flight finish once it is back (the
    evaluation reads its tests' result back from the container); every episode whole without
    a single retry, nothing left."""
    result, _ = run_chaos(tmp_path, "docker-restart-live", 4, timeout=600, client="seed")
    assert result["fault_detail"]["in_flight"], result["fault_detail"]
    assert result["episodes_whole_without_retries"] == 4, result["failure_examples"]
    assert result["request_failures_by_code"] == {} and result["step_retries"] == 0, result
    assert result["leftover_count"] == 0, result["leftovers"]


def test_a_frozen_redis_costs_no_call(tmp_path):
    """Redis SIGSTOPped for 10 s while an evaluation runs: the calls wait for it."""
    result, _ = run_chaos(tmp_path, "redis-sigstop", 4, timeout=600, client="seed")
    assert result["episodes_whole_without_retries"] == 4, result["failure_examples"]
    assert result["request_failures_by_code"] == {} and result["step_retries"] == 0, result
    assert result["leftover_count"] == 0, result["leftovers"]


def test_a_sentinel_failover_costs_no_episode(tmp_path):
    """kill -9 of the Redis primary behind Sentinel while an evaluation runs: the calls wait
    for the promoted replica. A write the replica had not yet received when the primary died
    may lose a job's record (WORKER_LOST, retryable); nothing else may fail."""
    result, _ = run_chaos(tmp_path, "sentinel-failover", 4, timeout=600, client="seed")
    assert result["episodes_whole"] == 4, result["failure_examples"]
    assert set(result["request_failures_by_code"]) <= {"WORKER_LOST"}, result
    assert result["leftover_count"] == 0, result["leftovers"]
