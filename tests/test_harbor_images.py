"""A Harbor task's environment.docker_image in a pool that pulls images
(TBENCH_DOCKER_IMAGE_SOURCE=pull): the task's own image is the agent's, taken from the local
daemon when it is there (no registry is reachable here), with no environment/Dockerfile."""

from __future__ import annotations

import io

import pytest

from poolcore.state import Store
from tests.conftest import BASE_IMAGE, private_stack, run_containers
from tests.test_harbor_tasks import FIXTURES_ROOT, harbor_close, harbor_reset, harbor_sh, harbor_solve

PREBUILT = "termpool-harbor-prebuilt:fixture"  # harbor-prebuilt's docker_image


@pytest.fixture(scope="module")
def prebuilt(base_image, docker_client):
    """The image under the task's docker_image name, as a pull would have left it."""
    dockerfile = f"FROM {BASE_IMAGE}\nRUN mkdir -p /srv/prebuilt && echo prebuilt > /etc/prebuilt-marker\nWORKDIR /srv/prebuilt\n"
    docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=PREBUILT, rm=True)
    yield PREBUILT
    docker_client.images.remove(PREBUILT, force=True)


@pytest.fixture(scope="module")
def pull_stack(prebuilt, docker_client):
    env = {
        "DATASET_DIR": str(FIXTURES_ROOT),
        "TBENCH_DOCKER_IMAGE_SOURCE": "pull",
        "TBENCH_DOCKER_PULL_PREFIX": "nowhere.invalid/",
    }
    yield from private_stack(docker_client, env)


def test_docker_image_without_dockerfile_in_pull_mode(pull_stack, docker_client):
    lease, _ = harbor_reset(pull_stack, "harbor-prebuilt")
    [main] = run_containers(docker_client, Store(pull_stack.redis), lease)
    assert PREBUILT in main.image.tags and main.labels["termpool.task"] == "harbor-prebuilt"
    assert harbor_sh(pull_stack, lease, "cat /etc/prebuilt-marker").strip() == "prebuilt"
    assert "No such file" in harbor_sh(pull_stack, lease, "ls /tests 2>&1")
    harbor_solve(pull_stack, lease, "harbor-prebuilt")  # from the image's WORKDIR, /srv/prebuilt
    reply = pull_stack.client.request("POST", "/evaluate", json={"lease_id": lease})
    assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    harbor_close(pull_stack, docker_client, lease)
