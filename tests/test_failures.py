"""The failure taxonomy: codes by exception type, no Docker needed."""

import docker.errors
import pytest
import requests

from termpool import failures

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
    assert failures.classify(ValueError("x")) == "INTERNAL"


def test_classify_follows_the_cause_chain():
    try:
        try:
            raise requests.exceptions.ConnectionError("refused")
        except requests.exceptions.ConnectionError as inner:
            raise docker.errors.DockerException("Error while fetching server API version") from inner
    except docker.errors.DockerException as exc:
        assert failures.classify(exc) == "BACKEND_UNAVAILABLE"
