"""What an idle host costs (docs/density.md, "The idle cost of a full host"): its periodic sweeps
ask Docker for no more than they need. Against a real stack with beat whose workers reach
dockerd through the fault proxy (tests/docker_fault_proxy.py), which counts their requests;
and the benchmark itself (bench/idle_cost.py), small."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests

from devstack import ROOT
from tests.conftest import proxied_stack, wait_for
from tests.test_runs_api import finished, submit

RUNS = 4
CHECK_SECONDS = 2  # DISK_CHECK_SECONDS of the stack
INSPECT = r"/containers/[^/]+/json"
LISTING = r"/containers/json"


@pytest.fixture(scope="module")
def counted(base_image, docker_client):
    """A stack with beat whose workers' Docker requests the proxy counts."""
    env = {"WARM_POOL_SIZE": "0", "DISK_CHECK_SECONDS": str(CHECK_SECONDS)}
    yield from proxied_stack(docker_client, env, beat=True)


def test_idle_sweeps_inspect_no_container_again(counted):
    """Over several disk checks (and a reconcile) of a host with idle runs, the sweeps list the
    host's containers each time but inspect none they have seen: the SDK's containers.list
    inspected every container it listed, on every check."""
    stack, proxy = counted
    runs = []
    for _ in range(RUNS):
        started = submit(stack, "hello-file")
        assert finished(stack, started["job_id"])["state"] == "succeeded"
        runs.append(started["run_id"])
    time.sleep(2 * CHECK_SECONDS)  # a check has seen every run's container
    inspects, listings = proxy.count("GET", INSPECT), proxy.count("GET", LISTING)
    time.sleep(6 * CHECK_SECONDS)
    checks = proxy.count("GET", LISTING) - listings
    assert checks >= 4, f"only {checks} listings of the host's containers: the sweeps did not run"
    assert proxy.count("GET", INSPECT) - inspects == 0, "an idle sweep inspected containers again"
    for run_id in runs:
        assert requests.delete(f"{stack.url}/v1/runs/{run_id}", timeout=30).status_code == 202
    assert wait_for(lambda: not stack.get("/status").json()["pool"]["pending_closes"], 120)


def test_the_idle_cost_benchmark_measures_a_small_host(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.idle_cost",
            "--runs",
            "3",
            "--window",
            "6",
            "--settle",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (path,) = tmp_path.glob("idle-cost-*.json")
    result = json.loads(path.read_text())
    assert result["ok"] and result["live_runs"] == 3 and result["closed"], result
    percent = result["cpu_percent_of_one_core"]
    own = ("facade", "build", "lifecycle", "exec", "eval", "teardown", "beat")
    assert percent["termpool"] == pytest.approx(sum(percent[group] for group in own), abs=0.05)
    assert "| termpool |" in proc.stdout
