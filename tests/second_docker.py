"""The second Docker daemon (devstack/second_docker.py) as a module fixture: a second worker
host's daemon with the test base image in it, removed at the module's end.

Module-scoped: each module that imports the fixture gets a daemon of its own (pytest makes one
per importing module whatever the scope), and a session scope held every one of them, each in
one of the machine's SLOTS, until the session ended: a fifth module waited for a slot."""

from __future__ import annotations

import uuid

import pytest

from devstack.second_docker import SecondDocker


@pytest.fixture(scope="module")
def second_docker(base_image):
    """A second Docker daemon with the test base image in it."""
    daemon = SecondDocker()
    try:
        daemon.start()
        daemon.load_image(base_image)
        yield daemon
    finally:
        daemon.stop()


def two_host_stack(daemon: SecondDocker, docker_client, env: dict | None = None):
    """A stack with these settings whose own workers (host_id) use the machine's dockerd and a
    second host's (host_b) this daemon, with `daemons` by host id; for a module fixture (`yield
    from`). Checks that neither daemon keeps containers of it."""
    from devstack import Stack
    from tests.conftest import stop_checking_leaks

    stack = Stack(env=env).start()
    stack.host_b = "b" + uuid.uuid4().hex[:8]
    stack.start_host(stack.host_b, daemon.host_env())
    second = daemon.client()
    stack.daemons = {stack.host_id: docker_client, stack.host_b: second}
    yield stack
    try:
        stop_checking_leaks(stack, docker_client)
        left = second.containers.list(all=True, filters={"label": f"termpool.host={stack.host_b}"})
        assert not left, f"containers left on the second daemon: {[c.name for c in left]}"
    finally:
        second.close()
