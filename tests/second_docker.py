"""The second Docker daemon (devstack/second_docker.py) as a session fixture: a second worker
host's daemon with the test base image in it, removed at the end."""

from __future__ import annotations

import pytest

from devstack.second_docker import SecondDocker


@pytest.fixture(scope="session")
def second_docker(base_image):
    """A second Docker daemon with the test base image in it."""
    daemon = SecondDocker()
    try:
        daemon.start()
        daemon.load_image(base_image)
        yield daemon
    finally:
        daemon.stop()
