"""The build worker's processes are replaced after BUILD_CHILD_MAX_TASKS builds (Celery's
--max-tasks-per-child), so what a build process accumulates (Docker connections, memory: the
soak, docs/soak.md) has a bound."""

from __future__ import annotations

import psutil
import pytest

from tests.conftest import Router, private_stack, wait_for


@pytest.fixture(scope="module")
def one_build_per_process(base_image, docker_client):
    yield from private_stack(docker_client, {"BUILD_CHILD_MAX_TASKS": "1", "BUILD_CONCURRENCY": "1"})


def build_processes(stack) -> set[int]:
    return {child.pid for child in psutil.Process(stack.procs["build"].pid).children()}


def test_a_build_process_is_replaced_after_its_builds(one_build_per_process):
    stack = one_build_per_process
    assert wait_for(lambda: len(build_processes(stack)) == 1, 30), build_processes(stack)
    before = build_processes(stack)
    router = Router(stack)
    lease = router.allocate("hello-file")
    assert router.reset(lease, "hello-file").status_code == 200  # a fresh stack: its image job runs
    replaced = wait_for(lambda: len(build_processes(stack)) == 1 and build_processes(stack) != before, 30)
    assert replaced, (before, build_processes(stack))
    router.close(lease)
