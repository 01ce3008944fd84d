"""Pull mode (prefix + task name, no build) and COMPOSE_OVERRIDE_PATH layered over every task."""

from __future__ import annotations

import pytest

from devstack import FIXTURES, Stack
from tests.conftest import Router, wait_for

PREFIX = "termpool-pulltest/"


@pytest.fixture(scope="module")
def pull_stack(base_image, docker_client, tmp_path_factory):
    image, _ = docker_client.images.build(path=str(FIXTURES / "hello-file"), rm=True, forcerm=True)
    image.tag(PREFIX + "hello-file")
    override = tmp_path_factory.mktemp("override") / "override.yaml"
    override.write_text("services:\n  client:\n    environment:\n      - TP_OVERRIDE=layered\n")
    s = Stack(
        env={
            "TBENCH_DOCKER_IMAGE_SOURCE": "pull",
            "TBENCH_DOCKER_PULL_PREFIX": PREFIX,
            "COMPOSE_OVERRIDE_PATH": str(override),
        }
    ).start()
    yield s
    s.stop()
    docker_client.images.remove(PREFIX + "hello-file", force=True)


def test_pull_mode_uses_prefixed_image_and_override(pull_stack, docker_client):
    router = Router(pull_stack)
    lease = router.allocate("hello-file")
    reply = router.reset(lease, "hello-file")
    assert reply.status_code == 200, reply.text
    assert router.sh(lease, "echo $TP_OVERRIDE").strip() == "layered"
    [container] = router.run_containers(docker_client, lease)
    assert container.attrs["Config"]["Image"] == PREFIX + "hello-file"
    router.solve(lease, "hello-file")
    assert router.evaluate(lease).json()["score"] == 1.0
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60)


def test_pull_mode_missing_image_is_a_clear_error(pull_stack, docker_client):
    router = Router(pull_stack)
    lease = router.allocate("partial-pass")
    reply = router.reset(lease, "partial-pass")
    assert reply.status_code == 500
    assert f"{PREFIX}partial-pass" in reply.json()["error"]
    assert router.run_containers(docker_client, lease) == []
    router.close(lease)
