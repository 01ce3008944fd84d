"""schemathesis against the real stack over HTTP: /openapi.json must describe exactly what the
code accepts and answers, with 0 failures.

The schemathesis CLI (pinned in requirements-dev.txt) runs every check it has (server errors,
status codes, content types, response schemas, negative data rejected, positive data accepted,
undeclared methods answered 405 with Allow, ...) with a fixed seed and the bounded budget of
tests/fuzz/schemathesis.toml, which also says what is allowed on purpose and why. The stack
has a DATASET_DIR with no task in it, so no reset or run ever starts a container; the leases
the fuzzer's /allocate calls take are closed afterwards and /status must show none left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import requests

from devstack import ROOT, Stack
from poolcore.state import Store
from tests.conftest import leftovers, wait_for

CONFIG = ROOT / "tests" / "fuzz" / "schemathesis.toml"


@pytest.fixture(scope="module")
def fuzz_stack(docker_client, tmp_path_factory):
    dataset = tmp_path_factory.mktemp("empty-dataset")
    stack = Stack(env={"DATASET_DIR": str(dataset)}).start()
    yield stack
    stack.stop()
    assert leftovers(docker_client, stack.host_id) == []


def close_every_lease(stack: Stack) -> int:
    store = Store.from_url(stack.env["REDIS_URL"])
    leases = store.live_runs(stack.host_id)
    for lease in leases:
        assert requests.post(stack.url + "/close", json={"lease_id": lease}, timeout=60).json()["ok"]
    return len(leases)


def test_schemathesis_finds_no_failure(fuzz_stack, tmp_path):
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG),
        "run",
        f"{fuzz_stack.url}/openapi.json",
        "--checks",
        "all",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    close_every_lease(fuzz_stack)
    assert run.returncode == 0, f"schemathesis found failures:\n{run.stdout[-30000:]}\n{run.stderr[-3000:]}"
    suites = [ET.parse(path).getroot() for path in tmp_path.glob("*.xml")]
    assert len(suites) == 1, run.stdout[-3000:]
    cases = list(suites[0].iter("testcase"))
    operations = {case.get("name") for case in cases}
    assert {"POST /allocate", "POST /reset", "POST /v1/runs", "GET /v1/jobs/{job_id}"} <= operations, operations
    assert not [case for case in cases if case.find("failure") is not None or case.find("error") is not None]

    def drained():
        pool = fuzz_stack.get("/status").json()["pool"]
        return pool["total_active_runs"] == 0 and pool["pending_closes"] == 0 and not pool["tasks"]

    assert wait_for(drained, timeout=120), fuzz_stack.get("/status").json()
