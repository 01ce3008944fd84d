"""`flask --app app dataset ...` on Harbor tasks and on datasets mixing both formats: check,
prebuild and download of a Harbor dataset repository (a local git origin); oracle is in
tests/test_harbor_tasks.py, against that file's stack."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from cli import download as dl
from devstack import FIXTURES
from tests.test_dataset_cli import cli, commit_all, git
from tests.test_harbor_tasks import HARBOR

SERVED = ["harbor-hello", "harbor-partial", "harbor-no-reward", "harbor-compose-sidecar", "harbor-env"]


def mixed(root: Path, harbor: list[str], original: list[str] = ["hello-file"]) -> Path:  # noqa: B006
    for name in harbor:
        shutil.copytree(HARBOR / name, root / name)
    for name in original:
        shutil.copytree(FIXTURES / name, root / name)
    return root


@pytest.mark.unit
def test_check_a_mixed_dataset(tmp_path):
    data = mixed(tmp_path / "ds", [*SERVED, "harbor-prebuilt", "harbor-multi-step"])
    result = cli(tmp_path)("check", data, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    problems = {p["task"]: p["problem"] for p in report["problems"]}
    assert report["tasks"] == len(SERVED) + 3 and set(problems) == {"harbor-prebuilt", "harbor-multi-step"}
    assert "multi-step tasks (steps/) are not supported" in problems["harbor-multi-step"]
    assert "TBENCH_DOCKER_IMAGE_SOURCE=build" in problems["harbor-prebuilt"]
    # A pool that pulls takes the docker_image; the other tasks stay clean there too.
    result = cli(tmp_path, TBENCH_DOCKER_IMAGE_SOURCE="pull")("check", data, "--json")
    assert {p["task"] for p in json.loads(result.stdout)["problems"]} == {"harbor-multi-step"}


@pytest.mark.unit
def test_check_names_a_broken_harbor_task(tmp_path):
    data = mixed(tmp_path / "ds", ["harbor-hello", "harbor-compose-sidecar"], [])
    (data / "harbor-hello" / "tests" / "test.sh").unlink()
    compose = data / "harbor-compose-sidecar" / "environment" / "docker-compose.yaml"
    compose.write_text(compose.read_text() + "    privileged: true\n")
    result = cli(tmp_path)("check", data, "--json")
    problems = {p["task"]: p["problem"] for p in json.loads(result.stdout)["problems"]}
    assert result.exit_code == 1 and "no tests/test.sh" in problems["harbor-hello"]
    assert "privileged" in problems["harbor-compose-sidecar"]


def test_prebuild_a_mixed_dataset(tmp_path, base_image, docker_client, redis_server):
    suffix = uuid.uuid4().hex[:8]  # fresh image names, so something is really built
    data = tmp_path / "ds"
    shutil.copytree(HARBOR / "harbor-hello", data / f"harbor-hello-{suffix}")
    shutil.copytree(HARBOR / "harbor-compose-sidecar", data / f"harbor-sidecar-{suffix}")
    shutil.copytree(FIXTURES / "hello-file", data / f"hello-{suffix}")
    port = redis_server.connection_pool.connection_kwargs["port"]
    images = []
    try:
        result = cli(tmp_path, REDIS_URL=f"redis://127.0.0.1:{port}/0")(
            "prebuild", data, "--hosts", "here", "-j", "2", "--json"
        )
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        images = [t["image"] for t in report["tasks"]]
        assert report["built"] == 3 and sorted(images) == sorted(f"tb__{p.name}__client" for p in data.iterdir())
        for image in images:
            docker_client.images.get(image)
        kv = docker_client.images.list(filters={"reference": f"tb__harbor-sidecar-{suffix}*"})
        assert len(kv) == 2  # main and the sidecar's own build
        images += [tag for i in kv for tag in i.tags]
    finally:
        for image in set(images):
            try:
                docker_client.images.remove(image, force=True)
            except Exception:
                pass


@pytest.fixture
def harbor_origin(tmp_path) -> Path:
    """A repository laid out like Terminal-Bench 2: task folders at the top level, beside
    files and folders that are not tasks."""
    repo = tmp_path / "tb2"
    for name in ("harbor-hello", "harbor-partial"):
        shutil.copytree(HARBOR / name, repo / name)
    (repo / "README.md").write_text("a dataset\n")
    (repo / ".github" / "workflows").mkdir(parents=True)
    (repo / ".github" / "workflows" / "ci.yaml").write_text("on: push\n")
    (repo / "scripts").mkdir()
    (repo / "scripts" / "lint.sh").write_text("true\n")
    commit_all(repo)
    return repo


@pytest.mark.unit
def test_download_a_harbor_dataset_with_tasks_at_the_top_level(tmp_path, harbor_origin):
    assert dl.DATASETS["tbench2"].subdirs == ("tasks", dl.ROOT)
    dest = tmp_path / "datasets"
    run = cli(tmp_path)
    result = run("download", "tbench2", "--origin", harbor_origin, "--dest", dest)
    assert result.exit_code == 0, result.output
    target = dest / "tbench2"
    assert sorted(p.name for p in target.iterdir()) == [".termpool-source.json", "harbor-hello", "harbor-partial"]
    assert (target / "harbor-hello" / "tests" / "test.sh").is_file()
    assert json.loads((target / ".termpool-source.json").read_text())["subdir"] == "."
    assert run("check", target).exit_code == 0
    assert [p.name for p in dest.iterdir()] == ["tbench2"]  # no work folders left


@pytest.mark.unit
def test_download_a_harbor_dataset_nested_under_tasks(tmp_path, harbor_origin):
    (harbor_origin / "tasks").mkdir()
    for name in ("harbor-hello", "harbor-partial"):
        git("mv", name, f"tasks/{name}", cwd=harbor_origin)
    git("commit", "-q", "-m", "nest", cwd=harbor_origin)
    dest = tmp_path / "datasets"
    result = cli(tmp_path)("download", "tbench2", "--origin", harbor_origin, "--dest", dest)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (dest / "tbench2").iterdir()) == [
        ".termpool-source.json",
        "harbor-hello",
        "harbor-partial",
    ]
    assert json.loads((dest / "tbench2" / ".termpool-source.json").read_text())["subdir"] == "tasks"
