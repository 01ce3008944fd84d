"""Whole episodes on fixture tasks shaped like real terminal-bench tasks: each case builds the
task's images, resets, makes a tool call, applies the reference solution through the tools
(as an agent would), scores 1.0 at evaluation and closes, leaving no container, network,
process or socket folder behind. One stack of its own serves every case.

| fixture | shape |
|---|---|
| redis-db-sidecar | a database sidecar (redis-server from Debian's packages) that must be healthy before the client starts; the tests read what the solution wrote into it |
| nginx-sshd-services | long-running services (nginx and sshd from Debian's packages) started by the solution, tested in place at evaluation |
| compose-dockerfile-names | a Dockerfile of its own per service (`Dockerfile.agent`, `api.Dockerfile`); the default `Dockerfile` is a decoy that fails to build |
| fifo-repl | a line-oriented program driven through named pipes |
| tmux-detached | the solution leaves its own tmux server running in the container |
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest

from devstack import FIXTURES
from tests.conftest import Router, private_stack, wait_for

SSH = (
    "ssh -p 2222 -i /root/.ssh/id_ed25519 -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
)


@pytest.fixture(scope="module")
def shapes(base_image, docker_client, tmp_path_factory):
    # Its own socket folder, so that the test can see each run's folder go at close.
    yield from private_stack(docker_client, {"POOL_SOCKET_DIR": str(tmp_path_factory.mktemp("sockets"))})


@pytest.fixture(scope="module")
def driver(shapes) -> Router:
    return Router(shapes)


def by_service(containers: list) -> dict:
    return {c.labels.get("com.docker.compose.service", "client"): c for c in containers}


def started_at(container) -> float:
    return datetime.fromisoformat(container.attrs["State"]["StartedAt"]).timestamp()


# ---- what each case checks around the solution -----------------------------------------------
def redis_db_before(driver, lease, containers):
    """The database was healthy, and seeded, before the client container started."""
    assert driver.sh(lease, "redis-cli -h db hlen prices").strip() == "4"
    ready_at = float(driver.sh(lease, "redis-cli -h db get ready_at").strip())
    services = by_service(containers)
    assert set(services) == {"client", "db"}
    assert services["db"].attrs["State"]["Health"]["Status"] == "healthy"
    assert started_at(services["client"]) > ready_at


def redis_db_after(driver, lease, solution_output):
    assert driver.sh(lease, "redis-cli -h db get inventory:value").strip() == "97395"


def services_before(driver, lease, containers):
    """Nothing listens yet: the solution starts the services."""
    assert driver.sh(lease, "curl -s -o /dev/null -w '%{http_code}' http://localhost:8080/").strip() == "000"


def services_after(driver, lease, solution_output):
    """Still running in later calls, once the solution's own call has ended."""
    assert driver.sh(lease, "curl -fsS http://localhost:8080/version.txt").strip() == "v1.4.2"
    assert driver.sh(lease, f"{SSH} deploy@localhost id -un").split()[-1] == "deploy"


def dockerfile_names_before(driver, lease, containers):
    assert driver.sh(lease, "cat /etc/built-from").strip() == "Dockerfile.agent"
    services = by_service(containers)
    assert set(services) == {"client", "api"}
    label = "org.termpool.fixture.dockerfile"
    assert services["client"].image.labels[label] == "Dockerfile.agent"
    assert services["api"].image.labels[label] == "api.Dockerfile"
    assert services["api"].image.tags == ["tb__compose-dockerfile-names__api:latest"]


def dockerfile_names_after(driver, lease, solution_output):
    assert driver.sh(lease, "cat /app/total.txt").strip().isdigit()


def fifo_before(driver, lease, containers):
    assert driver.sh(lease, "command -v ledger").strip() == "/usr/local/bin/ledger"


def fifo_after(driver, lease, solution_output):
    assert "-> confirmed" in solution_output and "quit -> bye" in solution_output, solution_output
    assert driver.sh(lease, "test -p /app/ledger.in && echo fifo").strip() == "fifo"


def tmux_before(driver, lease, containers):
    assert driver.sh(lease, "tmux has-session -t ticker 2>/dev/null && echo running || echo none").strip() == "none"


def tmux_after(driver, lease, solution_output):
    assert driver.sh(lease, "tmux ls").startswith("ticker: 1 windows")


CASES = {
    "redis-db-sidecar": (redis_db_before, redis_db_after, []),
    "nginx-sshd-services": (services_before, services_after, ["nginx: master process", "sshd"]),
    "compose-dockerfile-names": (dockerfile_names_before, dockerfile_names_after, []),
    "fifo-repl": (fifo_before, fifo_after, []),
    "tmux-detached": (tmux_before, tmux_after, ["tmux", "ticker"]),
}


# ---- the episode ---------------------------------------------------------------------------
def host_processes(containers: list) -> dict[int, str]:
    """Host pid -> command line of every process in the run's containers."""
    seen = {}
    for container in containers:
        top = container.top(ps_args="-eo pid,args")
        pid_col, cmd_col = top["Titles"].index("PID"), top["Titles"].index("COMMAND")
        seen.update({int(row[pid_col]): row[cmd_col] for row in top["Processes"]})
    return seen


def still_alive(processes: dict[int, str]) -> dict[int, str]:
    """Those of the processes that still run (the same pid with the same command line)."""
    alive = {}
    for pid, cmd in processes.items():
        try:
            now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if now and now == cmd.strip():
            alive[pid] = cmd
    return alive


def graded_output(shapes, lease: str) -> str:
    logs = list(shapes.output_root.rglob(f"*{lease}/tests.log"))
    return logs[0].read_text(errors="replace")[-4000:] if logs else "(no tests.log)"


@pytest.mark.parametrize("task", list(CASES))
def test_whole_episode(shapes, driver, docker_client, task):
    before, after, expected_processes = CASES[task]
    started = time.monotonic()
    lease = driver.allocate(task)
    reply = driver.reset(lease, task)
    assert reply.status_code == 200, reply.text
    reset_s = time.monotonic() - started  # the build (when the host lacks the images) and the start

    containers = driver.run_containers(docker_client, lease)
    before(driver, lease, containers)
    script = (FIXTURES / task / "solution.sh").read_text()
    driver.tool(lease, "shell_write_content_to_file", content=script, file_path="/tmp/solution.sh")
    solution_output = driver.sh(lease, "bash /tmp/solution.sh", timeout=120)
    after(driver, lease, solution_output)

    processes = host_processes(driver.run_containers(docker_client, lease))
    assert processes
    for name in expected_processes:
        assert any(name in cmd for cmd in processes.values()), (name, processes)
    reply = driver.evaluate(lease)
    assert reply.status_code == 200, reply.text
    assert reply.json()["score"] == 1.0, graded_output(shapes, lease)

    owners = {c.labels["termpool.run"] for c in driver.run_containers(docker_client, lease)}
    assert driver.close(lease) == {"ok": True, "found": True}
    assert wait_for(lambda: not driver.run_containers(docker_client, lease), 90), "teardown left containers"
    episode_s = time.monotonic() - started
    networks = {"label": f"termpool.run={lease}"}
    assert wait_for(lambda: not docker_client.networks.list(filters=networks), 60), "teardown left a network"
    assert not still_alive(processes), "processes of the run outlived its close"
    socket_dir = Path(shapes.env["POOL_SOCKET_DIR"])
    assert wait_for(lambda: not any((socket_dir / owner).exists() for owner in owners), 30), "socket folder left"
    print(f"\n{task}: reset {reset_s:.1f} s (build + start), whole episode {episode_s:.1f} s")
