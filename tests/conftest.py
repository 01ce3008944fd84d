"""Shared fixtures: the test base image, a real stack (Redis, Celery workers, gunicorn;
devstack/), and a router-like driver of the pool API on termpool.client."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import docker
import httpx
import pytest

from app import create_app, stop_app
from devstack import ROOT, Stack, free_port
from poolcore.config import load_settings
from poolcore.state import Store
from termpool.client import task_meta
from tests.docker_fault_proxy import FaultProxy

BASE_IMAGE = os.environ.get("TERMPOOL_BASE_IMAGE", "termpool-test-base:bookworm")


# Test files that kill workers, restart daemons or compare timings: a neighbour's load would
# make them lie, so scripts/test.sh runs them after the others, one at a time (marker `alone`).
ALONE = {
    "test_chaos_smoke.py",
    "test_lost_work.py",
    "test_grey_faults.py",
    "test_failure_detection.py",
    "test_idle_cost.py",
    "test_bench_smoke.py",
    "test_harbor_tasks.py",  # counts the machine's build containers
}
ALONE_FOLDERS = {"shell_tools"}  # session spawns and the socket-against-exec comparison


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in ALONE or ALONE_FOLDERS & set(item.path.parts):
            item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium under Playwright, one per browser test module (tests/browser.py)."""
    from playwright.sync_api import sync_playwright

    from tests.browser import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def base_image() -> str:
    subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], check=True, capture_output=True)
    return BASE_IMAGE


@pytest.fixture(scope="session")
def docker_client():
    return docker.from_env()


def leftovers(client, host_id: str) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": f"termpool.host={host_id}"})]


def run_containers(docker_client, store: Store, run_id: str) -> list:
    """A run's containers: labelled with its id or, when a warm spare served its latest reset,
    with that spare's warm id (labels are set when a container is created)."""
    env = (store.get_run(run_id) or {}).get("env") or {}
    owners = [run_id, *([env["warm_id"]] if env.get("warm_id") else [])]
    return [
        container
        for owner in owners
        for container in docker_client.containers.list(
            all=True, filters={"label": f"termpool.run={owner}"}, ignore_removed=True
        )
    ]


def held_by_pool(store: Store, container) -> bool:
    """A warm spare the pool still holds (pooled or starting): no leftover while the stack is
    up (a clean stop removes it)."""
    run = container.labels.get("termpool.run", "")
    return run.startswith("warm-") and store.warm_known(run)


def stop_checking_leaks(s: Stack, docker_client) -> None:
    """Stop the stack, remove its containers, and fail if any were left (the warm pool's spares
    too: a clean stop removes them). Teardowns of runs the tests closed run in the background:
    they get a minute to finish first."""
    closing = Store(s.redis)  # the stack's Redis: its one server, or its Sentinel primary
    wait_for(lambda: not closing.closing_runs(s.host_id), 60, 0.5)
    owners = live_owners(closing, s.host_id)  # read before the stop takes Redis down
    stuck = closing.closing_runs(s.host_id)  # a teardown that never ran (its message lost?)
    s.stop()
    left = leftovers(docker_client, s.host_id)
    for container in docker_client.containers.list(all=True, filters={"label": f"termpool.host={s.host_id}"}):
        container.remove(force=True)
    assert not left, (
        f"containers leaked by the test session: {left}; runs still live at the stop: {owners}; "
        f"runs still closing after a minute: {stuck}"
    )


def live_owners(store: Store, host_id: str) -> dict:
    """What each run still live at a stack's stop says of itself, by the owner label of its
    containers (a run a warm spare served keeps the spare's name and label): a test that left
    a run open shows here, apart from a spare the stop failed to remove."""
    owners = {}
    for run_id in store.live_runs(host_id):
        run = store.get_run(run_id) or {}
        owner = (run.get("env") or {}).get("warm_id") or run_id
        owners[owner] = f"run {run_id} ({run.get('state')}, task {run.get('task_key')})"
    return owners


@pytest.fixture(scope="session")
def stack(base_image, docker_client):
    s = Stack().start()
    yield s
    stop_checking_leaks(s, docker_client)


class Router:
    """Drives the pool API the way an RL router does, through termpool.client (no retries: a
    test sees every failure). allocate, tool and sh raise the client's typed error when a call
    fails; reset, evaluate and close give the raw reply (close: its JSON, once it is a 200),
    whose status code and fields the tests check."""

    def __init__(self, stack: Stack):
        self.stack = stack

    @property
    def pool(self):
        return self.stack.client  # the stack's current one (a restarted stack has a new one)

    def allocate(self, task_key: str, request_id: str | None = None) -> str:
        return self.pool.allocate(task_key, request_id=request_id).id

    def reset(self, lease: str, task: str, **extra) -> httpx.Response:
        body = {"lease_id": lease, "task_meta": task_meta(task, instruction=f"solve {task}"), **extra}
        return self.pool.request("POST", "/reset", json=body)

    def tool(self, lease: str, name: str, **arguments) -> str:
        return self.pool.lease(lease).tool(name, **arguments)

    def sh(self, lease: str, command: str, **kw) -> str:
        return self.tool(lease, "shell_exec", id="main", command=command, **{"block": True, "timeout": 60, **kw})

    def evaluate(self, lease: str) -> httpx.Response:
        return self.pool.request("POST", "/evaluate", json={"lease_id": lease})

    def close(self, lease: str) -> dict:
        reply = self.pool.request("POST", "/close", json={"lease_id": lease})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def solve(self, lease: str, task: str) -> None:
        """Apply the task's reference solution through the tools, as an agent would."""
        script = (ROOT / "tests" / "fixtures" / "tasks" / task / "solution.sh").read_text()
        self.tool(lease, "shell_write_content_to_file", content=script, file_path="/tmp/solution.sh")
        self.sh(lease, "bash /tmp/solution.sh")

    def solved_episode(self, docker_client, task: str) -> float:
        """A whole episode with the reference solution; the score, once the teardown is done."""
        lease = self.allocate(task)
        reply = self.reset(lease, task)
        assert reply.status_code == 200, reply.text
        self.solve(lease, task)
        reply = self.evaluate(lease)
        assert reply.status_code == 200, reply.text
        self.close(lease)
        assert wait_for(lambda: not self.run_containers(docker_client, lease), 90), "teardown did not run"
        return reply.json()["score"]

    def run_containers(self, docker_client, lease: str) -> list:
        return run_containers(docker_client, Store(self.stack.redis), lease)


@pytest.fixture(scope="session")
def router(stack) -> Router:
    return Router(stack)


def wait_for(check, timeout: float = 30.0, interval: float = 0.2):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    return check()


_apps_made: list = []  # by make_app, stopped when the test that made them ends


def make_app(settings: dict):
    """The facade's Flask app in this process, on these settings (not the process's), its
    background threads (liveness watch, monitor follower) stopped when the test ends: the Redis
    it reads may go before the session does (a module's stack, redis_server)."""
    app = create_app(load_settings(settings))
    _apps_made.append(app)
    return app


@pytest.fixture(autouse=True)
def stop_apps_made():
    yield
    while _apps_made:
        stop_app(_apps_made.pop())


@pytest.fixture
def fixtures_dir() -> Path:
    return ROOT / "tests" / "fixtures" / "tasks"


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server for tests of the state store alone."""
    import redis as redis_lib

    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""], stdout=subprocess.DEVNULL
    )
    client = redis_lib.Redis(port=port, decode_responses=True)
    wait_for(lambda: _pings(client), 10, 0.05)
    yield client
    proc.terminate()
    proc.wait()


def _pings(client) -> bool:
    try:
        return client.ping()
    except Exception:
        return False


def private_stack(docker_client, env: dict, beat: bool = False):
    """A stack of its own with these settings, for a module fixture (`yield from`); checks that
    it left no containers behind."""
    s = Stack(env=env, beat=beat).start()
    yield s
    stop_checking_leaks(s, docker_client)


def proxied_stack(docker_client, env: dict, beat: bool = False):
    """A stack of its own whose workers reach dockerd only through a new fault proxy
    (tests/docker_fault_proxy.py), for a module fixture (`yield from`: yields (stack, proxy));
    fails if the stack left containers behind."""
    proxy = FaultProxy(Path(tempfile.mkdtemp(prefix="tp-proxy-")) / "docker.sock").start()
    stack = Stack(env={"DOCKER_HOST": proxy.docker_host, **env}, beat=beat).start()
    yield stack, proxy
    stack.stop()
    left = leftovers(docker_client, stack.host_id)
    for container in docker_client.containers.list(all=True, filters={"label": f"termpool.host={stack.host_id}"}):
        container.remove(force=True)
    proxy.stop()
    assert not left, f"containers leaked: {left}"
