"""The terminal tools' fixtures: one container per transport (`env`), shared by the package's
test modules as the single module before them shared it."""

from __future__ import annotations

import docker
import pytest

from tests.shell_tools.support import (
    MODES,
    make_env,
)


@pytest.fixture(scope="package")
def client():
    return docker.from_env()


@pytest.fixture(scope="package", params=MODES)
def env(request, client, base_image, tmp_path_factory):
    e = make_env(client, base_image, request.param, tmp_path_factory)
    try:
        yield e
    finally:
        e.remove()


@pytest.fixture(scope="package")
def container(env):
    return env.container


@pytest.fixture
def sh(env):
    return env.shell()
