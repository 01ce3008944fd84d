"""A task environment's content digest (environments/image_digest.py): what changes an image
changes the digest, what does not leaves it; no Docker."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from environments.image_digest import build_digest, environment_digest

pytestmark = pytest.mark.unit


def context(root: Path, name: str = "ctx") -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM base\nCOPY app.sh /app.sh\n")
    (folder / "app.sh").write_text("echo hi\n")
    (folder / ".dockerignore").write_text("# notes\nnotes.txt\n")
    (folder / "notes.txt").write_text("not sent\n")
    return folder


def model(folder: Path, **build) -> dict:
    return {"services": {"client": {"build": {"context": str(folder), "dockerfile": "Dockerfile", **build}}}}


def test_what_decides_the_image_changes_the_digest(tmp_path):
    folder = context(tmp_path)
    first = environment_digest(model(folder))
    (folder / "Dockerfile").write_text("FROM base\nCOPY app.sh /app.sh\nRUN true\n")
    second = environment_digest(model(folder))
    assert second != first
    (folder / "app.sh").write_text("echo bye\n")
    third = environment_digest(model(folder))
    assert third != second
    os.chmod(folder / "app.sh", 0o755)
    assert environment_digest(model(folder)) != third
    assert environment_digest(model(folder, args={"VERSION": "2"})) != environment_digest(model(folder))
    assert environment_digest(model(folder, target="slim")) != environment_digest(model(folder))


def test_what_does_not_leaves_it(tmp_path):
    folder = context(tmp_path)
    first = environment_digest(model(folder))
    (folder / "notes.txt").write_text("ignored by .dockerignore\n")
    assert environment_digest(model(folder)) == first
    assert environment_digest(model(folder, args={"HTTP_PROXY": "http://proxy:3128"})) == first
    # Another host's copy of the task (another path, another task name): the same digest.
    elsewhere = shutil.copytree(folder, tmp_path / "other-host" / "another-task")
    assert environment_digest(model(elsewhere)) == first


def test_every_built_service_counts_and_a_task_that_builds_nothing_has_none(tmp_path):
    one, two = context(tmp_path, "one"), context(tmp_path, "two")
    both = {"services": {"client": model(one)["services"]["client"], "db": model(two)["services"]["client"]}}
    before = environment_digest(both)
    (two / "app.sh").write_text("echo db\n")
    assert environment_digest(both) != before
    assert environment_digest({"services": {"client": {"image": "debian:bookworm"}}}) == ""
    assert build_digest(model(one)["services"]["client"]["build"]) != build_digest(
        model(two)["services"]["client"]["build"]
    )
