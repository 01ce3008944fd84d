"""The whole stack from docker-compose.yml: build termpool's image (deploy/build-image.sh, from
the local test base image, nothing pulled), `up`, four whole episodes through the pool API sent
the moment /healthz answers, the api healthy by /readyz, the Docker socket only in the workers,
then `down -v` leaves nothing behind.

Set TERMPOOL_SKIP_COMPOSE=1 to skip it (it builds an image: about a minute cold, seconds warm).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests

from devstack import FIXTURES, ROOT, WORKER_KINDS, free_port
from environments.docker_client import compose_command
from termpool.client import Pool
from tests.conftest import wait_for
from tests.test_startup import episodes_at_once

pytestmark = pytest.mark.skipif(
    os.environ.get("TERMPOOL_SKIP_COMPOSE", "").strip() in ("1", "true", "yes"), reason="TERMPOOL_SKIP_COMPOSE is set"
)

SERVICES = {"redis", "registry", "api", "scheduler", "flower", *WORKER_KINDS}
DOCKER_SOCKET = "/var/run/docker.sock"


@pytest.fixture(scope="module")
def termpool_image(base_image) -> str:
    """deploy/build-image.sh from the test base image; the id it prints (not the tag, which a
    concurrent build elsewhere may move)."""
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy" / "build-image.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "BASE_IMAGE": base_image},
    )
    assert proc.returncode == 0, f"build-image.sh failed:\n{proc.stderr[-4000:]}"
    image = proc.stdout.strip().splitlines()[-1]
    assert image.startswith("sha256:"), proc.stdout
    print(f"termpool image {image} ready in {time.monotonic() - started:.1f} s ({proc.stderr.strip()})")
    return image


class ComposeStack:
    def __init__(self, image: str, output_root: Path):
        self.project = "tpc" + uuid.uuid4().hex[:10]
        self.host_id = "c" + uuid.uuid4().hex[:10]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = Pool(self.url, timeout=10, job_timeout=600, retries=0)
        self.env = {
            **os.environ,
            "TERMPOOL_IMAGE": image,
            "REDIS_IMAGE": image,
            "POOL_HOST_ID": self.host_id,
            "DATASET_DIR": str(FIXTURES),
            "TBENCH_OUTPUT_ROOT": str(output_root),
            "ENV_SERVER_PORT": str(self.port),
            "FLOWER_PORT": str(free_port()),
            "FLOWER_HOST": "127.0.0.1",
            "REGISTRY_PORT": str(free_port()),  # beside the machine's own registry (start-backends)
            "REGISTRY_URL": "",
            "FLOWER_BASIC_AUTH": "termpool:" + uuid.uuid4().hex,
            # Whatever the caller's shell has, this stack is open, builds its images, no override.
            "POOL_API_TOKEN": "",
            "POOL_ALLOWED_CLIENTS": "",
            "TBENCH_DOCKER_IMAGE_SOURCE": "build",
            "COMPOSE_OVERRIDE_PATH": "",
            "CONTAINER_MEMORY_LIMIT": "1g",
            "LIFECYCLE_CONCURRENCY": "4",
            "EXEC_CONCURRENCY": "8",
            "EVAL_CONCURRENCY": "4",
            "TEARDOWN_CONCURRENCY": "2",
            "WEB_CONCURRENCY": "1",
            "WEB_THREADS": "32",
        }

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*compose_command(), "-p", self.project, "-f", str(ROOT / "docker-compose.yml"), *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def logs(self) -> str:
        proc = self.compose("logs", "--no-color", "--tail", "60", timeout=60)
        return (proc.stdout + proc.stderr)[-8000:]


def _host_state(stack: ComposeStack) -> str:
    try:
        return stack.client.status()["hosts"].get(stack.host_id, {}).get("state", "")
    except Exception:
        return ""


def _health(docker_client, stack: ComposeStack, service: str) -> str:
    label = [f"com.docker.compose.project={stack.project}", f"com.docker.compose.service={service}"]
    for container in docker_client.containers.list(filters={"label": label}):
        return container.attrs["State"].get("Health", {}).get("Status", "")
    return ""


def _remove_rules(host_id: str) -> None:
    """The stack's packet-filter rules outlive `down` (the next pool's apply would collect them:
    their bridge is gone); removed here so no other test ever meets them."""
    from environments import containment
    from poolcore.config import load_settings

    if shutil.which("iptables"):
        containment.remove(load_settings({"POOL_HOST_ID": host_id}))


def _names(docker_client, label: str) -> list[str]:
    """Names of the containers (any state) with this label; the low-level list, which does not
    trip over a container removed while it is being listed."""
    return [c["Names"][0].lstrip("/") for c in docker_client.api.containers(all=True, filters={"label": label})]


def test_compose_up_episode_and_down(termpool_image, docker_client, tmp_path):
    stack = ComposeStack(termpool_image, tmp_path / "outputs")
    (tmp_path / "outputs").mkdir()
    timings = {}
    try:
        started = time.monotonic()
        proc = stack.compose("up", "-d")
        assert proc.returncode == 0, f"compose up failed:\n{proc.stderr[-4000:]}"
        assert wait_for(stack.client.healthy, 180, 0.1), f"/healthz never answered:\n{stack.logs()}"
        timings["healthz"] = time.monotonic() - started

        # Four whole episodes on hello-file the moment /healthz answers, as an impatient
        # router sends them: the workers may still be starting, and their jobs wait for them.
        started = time.monotonic()
        failed = episodes_at_once(stack.url)
        assert not failed, f"{failed}\n{stack.logs()}"
        timings["episodes"] = time.monotonic() - started
        assert wait_for(lambda: _host_state(stack) == "serving", 60, 0.5), f"never serving:\n{stack.logs()}"
        # The api's healthcheck is /readyz: healthy once a host serves every queue kind.
        assert wait_for(lambda: _health(docker_client, stack, "api") == "healthy", 120, 1.0), stack.logs()
        assert wait_for(lambda: not _names(docker_client, f"termpool.host={stack.host_id}"), 120), (
            "the runs' containers outlived their close"
        )
        # The run's logs landed in the bind-mounted output root, at the host's path.
        assert list((tmp_path / "outputs").rglob("*")), "no run logs under TBENCH_OUTPUT_ROOT"

        # Every service is up; only the workers have the Docker socket; the API is not root.
        containers = docker_client.containers.list(filters={"label": f"com.docker.compose.project={stack.project}"})
        by_service = {c.labels["com.docker.compose.service"]: c for c in containers}
        assert set(by_service) == SERVICES, f"running: {sorted(by_service)}\n{stack.logs()}"
        with_socket = {
            name
            for name, c in by_service.items()
            if any(m.get("Destination") == DOCKER_SOCKET or m.get("Source") == DOCKER_SOCKET for m in c.attrs["Mounts"])
        }
        assert with_socket == set(WORKER_KINDS)
        for name in ("api", "flower", "scheduler"):
            assert by_service[name].attrs["Config"]["User"] not in ("", "0", "root"), name
        for name in ("api", *WORKER_KINDS):
            env = dict(e.split("=", 1) for e in by_service[name].attrs["Config"]["Env"])
            assert env["POOL_HOST_ID"] == stack.host_id and env["REDIS_URL"] == "redis://redis:6379/0"
        mounts = {m["Destination"]: m["Source"] for m in by_service["exec"].attrs["Mounts"]}
        assert mounts[str(FIXTURES)] == str(FIXTURES)
        assert mounts[str(tmp_path / "outputs")] == str(tmp_path / "outputs")

        # Flower, behind its basic auth, sees a worker of every kind.
        flower = f"http://127.0.0.1:{stack.env['FLOWER_PORT']}"
        auth = tuple(stack.env["FLOWER_BASIC_AUTH"].split(":", 1))

        def flower_kinds():
            try:
                reply = requests.get(flower + "/api/workers", params={"refresh": 1}, auth=auth, timeout=30)
            except requests.RequestException:
                return False
            names = [n for n in reply.json() if n.endswith(f"@{stack.host_id}")] if reply.ok else []
            return set(WORKER_KINDS) <= {n.split("-", 1)[0] for n in names}

        assert wait_for(flower_kinds, 60, 1.0), f"Flower does not list every worker kind:\n{stack.logs()}"
        assert requests.get(flower + "/api/workers", timeout=10).status_code == 401
    finally:
        started = time.monotonic()
        down = stack.compose("down", "-v", "--remove-orphans", "-t", "20", timeout=300)
        timings["down"] = time.monotonic() - started
        left_project = _names(docker_client, f"com.docker.compose.project={stack.project}")
        left_tasks = _names(docker_client, f"termpool.host={stack.host_id}")
        for name in left_tasks:
            docker_client.api.remove_container(name, force=True, v=True)
        _remove_rules(stack.host_id)
        print("compose stack timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    assert down.returncode == 0, down.stderr[-4000:]
    assert not left_project, f"containers of the compose project remain: {left_project}"
    assert not left_tasks, f"task containers of {stack.host_id} remain: {left_tasks}"
    assert not docker_client.networks.list(filters={"label": f"com.docker.compose.project={stack.project}"})


def test_compose_fresh_starts_serve_work_sent_at_the_first_healthz(termpool_image, docker_client, tmp_path):
    """Four more fresh `up`s (five with the test above), each sent four episodes the moment
    /healthz answers; each `down -v` leaves nothing."""
    for start in range(4):
        (tmp_path / f"outputs{start}").mkdir()
        stack = ComposeStack(termpool_image, tmp_path / f"outputs{start}")
        try:
            proc = stack.compose("up", "-d")
            assert proc.returncode == 0, f"compose up failed:\n{proc.stderr[-4000:]}"
            assert wait_for(stack.client.healthy, 180, 0.1), f"/healthz never answered:\n{stack.logs()}"
            failed = episodes_at_once(stack.url)
            assert not failed, f"start {start}: {failed}\n{stack.logs()}"
        finally:
            down = stack.compose("down", "-v", "--remove-orphans", "-t", "20", timeout=300)
            for name in _names(docker_client, f"termpool.host={stack.host_id}"):
                docker_client.api.remove_container(name, force=True, v=True)
            _remove_rules(stack.host_id)
        assert down.returncode == 0, down.stderr[-4000:]
        assert not _names(docker_client, f"com.docker.compose.project={stack.project}")
