"""Task compose files that would give a container power over the host are refused, and the
refused reset leaves nothing behind."""

from __future__ import annotations

import shutil

import pytest

from devstack import FIXTURES, Stack
from tests.conftest import Router

CLIENT = """services:
  client:
    build:
      dockerfile: Dockerfile
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    command: [ "sh", "-c", "sleep infinity" ]
"""
UNSAFE = {
    "privileged-client": CLIENT + "    privileged: true\n",
    "socket-client": CLIENT + "    volumes:\n      - /var/run/docker.sock:/var/run/docker.sock\n",
    "sysadmin-sidecar": CLIENT + "  helper:\n    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}\n"
    '    command: [ "sh", "-c", "sleep infinity" ]\n    cap_add: [ SYS_ADMIN ]\n',
    "external-volume": CLIENT + "    volumes:\n      - shared:/data\nvolumes:\n  shared:\n    external: true\n",
}


@pytest.fixture(scope="module")
def unsafe_stack(base_image, tmp_path_factory):
    dataset = tmp_path_factory.mktemp("unsafe-dataset")
    for name, compose in UNSAFE.items():
        shutil.copytree(FIXTURES / "hello-file", dataset / name)
        (dataset / name / "docker-compose.yaml").write_text(compose)
    s = Stack(env={"DATASET_DIR": str(dataset)}).start()
    yield s
    s.stop()


@pytest.mark.parametrize(
    "task, word",
    [
        ("privileged-client", "privileged"),
        ("socket-client", "Docker socket"),
        ("sysadmin-sidecar", "SYS_ADMIN"),
        ("external-volume", "external"),
    ],
)
def test_unsafe_compose_is_refused(unsafe_stack, docker_client, task, word):
    router = Router(unsafe_stack)
    lease = router.allocate(task)
    reply = router.reset(lease, task)
    assert reply.status_code == 500, reply.text
    assert word in reply.json()["error"]
    assert router.run_containers(docker_client, lease) == []
    assert not docker_client.networks.list(filters={"label": f"termpool.run={lease}"})
    router.close(lease)
