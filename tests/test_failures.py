"""The failure taxonomy: codes by exception type, no Docker needed."""

import os
import subprocess
import sys
from pathlib import Path

import docker.errors
import pytest
import requests

import environments.docker_client  # noqa: F401  (registers the docker SDK's codes)
from poolcore import failures

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.unit


def test_every_failure_class_has_a_known_code():
    for cls in failures.Failure.__subclasses__():
        assert cls.code in failures.CODES, cls


def test_task_errors_are_not_retryable_and_infrastructure_errors_are():
    for code in failures.CODES.values():
        if code.kind == "task":
            assert not code.retryable, code.name
        if code.kind == "infrastructure":
            assert code.retryable, code.name


def test_classify_by_type():
    assert failures.classify(failures.TaskBuildFailed("x")) == "TASK_BUILD_FAILED"
    assert failures.classify(TimeoutError()) == "TIMEOUT"
    assert failures.classify(requests.exceptions.ConnectionError()) == "BACKEND_UNAVAILABLE"
    assert failures.classify(docker.errors.APIError("boom")) == "DOCKER_ERROR"
    assert failures.classify(docker.errors.NotFound("gone")) == "DOCKER_ERROR"
    assert failures.classify(docker.errors.BuildError("bad step", [])) == "TASK_BUILD_FAILED"
    assert failures.classify(ValueError("x")) == "INTERNAL"


def test_classify_follows_the_cause_chain():
    try:
        try:
            raise requests.exceptions.ConnectionError("refused")
        except requests.exceptions.ConnectionError as inner:
            raise docker.errors.DockerException("Error while fetching server API version") from inner
    except docker.errors.DockerException as exc:
        assert failures.classify(exc) == "BACKEND_UNAVAILABLE"


def test_registering_codes_again_keeps_the_first_and_unknown_codes_are_refused():
    failures.register_codes({docker.errors.APIError: "INTERNAL"})
    assert failures.classify(docker.errors.APIError("boom")) == "DOCKER_ERROR"
    with pytest.raises(ValueError):
        failures.register_codes({KeyError: "NO_SUCH_CODE"})


def test_the_facade_loads_no_worker_or_docker_code():
    """create_app imports the failure taxonomy, but neither the Celery side (tasks/), the
    Docker side (environments/) nor the docker SDK."""
    code = (
        "import sys, app; app.create_app(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'tasks', 'environments', 'docker'}))"
    )
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0", "DATASET_DIR": "/tmp", "TBENCH_OUTPUT_ROOT": "/tmp"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
