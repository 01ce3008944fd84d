"""A host keeps its task images within IMAGE_DISK_BUDGET: its reconcile removes the least
recently used ones nothing uses, never one a live run's container was created from, and the
task of a removed image builds it again at its next start. A private stack over a temporary
dataset whose tasks have names of their own (other test sessions on this dockerd never see
these images go)."""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
import requests

from devstack import FIXTURES
from environments import image_budget
from environments.image_budget import TaskImage, choose
from poolcore.config import load_settings
from poolcore.state import Store
from tasks import image_budget as tasks_budget
from tests.conftest import Router, wait_for
from tests.test_task_images import FakeLock, closed, labelled_stack, reconcile, started
from tests.test_upload_images import HOST as UPLOAD_HOST
from tests.test_upload_images import build, task_path

SUFFIX = uuid.uuid4().hex[:8]
OLD, NEWER, LIVE = (f"budget-{name}-{SUFFIX}" for name in ("old", "newer", "live"))  # all hello-file


def tag(task: str) -> str:
    return f"tb__{task}__client"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    for task in (OLD, NEWER, LIVE):
        shutil.copytree(FIXTURES / "hello-file", root / task)
    return root


@pytest.fixture(scope="module")
def budgeted(base_image, docker_client, dataset):
    # A budget of one byte: every task image nothing uses is beyond it. No warm spares: a
    # spare would (rightly) keep its image in use.
    env = {"DATASET_DIR": str(dataset), "WARM_POOL_SIZE": "0", "IMAGE_DISK_BUDGET": "1"}
    yield from labelled_stack(docker_client, env, [tag(task) for task in (OLD, NEWER, LIVE)])


def image_id(docker_client, name: str) -> str | None:
    try:
        return docker_client.images.get(name).id
    except docker.errors.ImageNotFound:
        return None


# ---- with dockerd ---------------------------------------------------------------------------
def test_the_reconcile_removes_an_unused_image_beyond_the_budget_never_a_live_runs(budgeted, docker_client):
    router, store = Router(budgeted), Store(budgeted.redis)
    closed(router, docker_client, started(router, OLD))
    live = started(router, LIVE)
    # Each start noted its image's use (after its reply), with the task it was used for.
    assert wait_for(lambda: {tag(OLD), tag(LIVE)} <= set(store.image_uses(budgeted.host_id)), 30)
    assert store.image_task(budgeted.host_id, tag(OLD)) == OLD
    live_image = image_id(docker_client, tag(LIVE))

    reconcile(budgeted)
    assert wait_for(lambda: image_id(docker_client, tag(OLD)) is None, 60), "the unused image was not removed"
    assert image_id(docker_client, tag(LIVE)) == live_image, "the image of a live run's container was removed"
    assert router.sh(live, "echo still-here").strip() == "still-here"
    # The removed image's task is no longer marked built here: its next start builds it again.
    assert not store.image_ready(budgeted.host_id, OLD) and store.image_ready(budgeted.host_id, LIVE)
    again = started(router, OLD)
    assert router.sh(again, "echo rebuilt").strip() == "rebuilt"
    closed(router, docker_client, again)
    closed(router, docker_client, live)


def test_the_least_recently_used_goes_first(budgeted, docker_client):
    """The sweep itself, with a budget that holds all but one image: the one used longest ago
    goes, the one used since stays (a use noted later than another's build counts)."""
    router, store, host = Router(budgeted), Store(budgeted.redis), budgeted.host_id
    for task in (OLD, NEWER):
        closed(router, docker_client, started(router, task))
    now = time.time()
    store.note_image_use(host, tag(OLD), OLD, at=now + 100)  # both used after they were built,
    store.note_image_use(host, tag(NEWER), NEWER, at=now + 200)  # NEWER last
    images = [
        i for i in image_budget.host_images(host, store.image_uses(host), 0) if i.built_as in (tag(OLD), tag(NEWER))
    ]
    assert {i.last_used for i in images} == {now + 100, now + 200} and not any(i.in_use for i in images)

    lock = functools.partial(store.build_lock, host)
    forgotten = []
    budget = sum(i.size for i in images) - 1
    removed = image_budget.keep_within(images, budget, lock, forgotten.append)
    assert [i.built_as for i in removed] == [tag(OLD)] == forgotten
    assert image_id(docker_client, tag(OLD)) is None and image_id(docker_client, tag(NEWER))


def test_an_uploaded_tasks_image_goes_too_and_its_task_is_no_longer_ready(
    monkeypatch, redis_server, docker_client, base_image
):
    """The reconcile's step (tasks/image_budget.py) in this process, on images made as builds
    of uploaded tasks make them (tests/test_upload_images.py): the unused one goes and its task
    is no longer marked built (not while a live run names its task); the one a stopped
    container was created from stays; uses of images no longer there are forgotten."""
    redis_server.flushdb()
    store = Store(redis_server)
    monkeypatch.setattr(tasks_budget, "store", lambda: store)
    monkeypatch.setattr(tasks_budget, "settings", lambda: load_settings({"IMAGE_DISK_BUDGET": "1"}))
    unused, used = task_path(10), task_path(11)
    images = {path: build(docker_client, base_image, path) for path in (unused, used)}
    for path, image in images.items():
        store.mark_image_ready(UPLOAD_HOST, path)
        store.note_image_use(UPLOAD_HOST, image, path)
    store.note_image_use(UPLOAD_HOST, "tb__long-gone__client", "long-gone")
    gone = image_id(docker_client, images[unused]).removeprefix("sha256:")[:12]
    container = docker_client.containers.create(images[used], ["true"], labels={"termpool.host": UPLOAD_HOST})
    try:
        assert tasks_budget.keep_within_budget(UPLOAD_HOST, {unused}) == []  # a run of it is live
        assert tasks_budget.keep_within_budget(UPLOAD_HOST, set()) == [gone]
        assert image_id(docker_client, images[unused]) is None and image_id(docker_client, images[used])
        assert store.ready_images(UPLOAD_HOST) == {used}
        assert set(store.image_uses(UPLOAD_HOST)) == set(images.values())  # long-gone's forgotten
    finally:
        container.remove(force=True)
        for image in images.values():
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(image, force=True)


# ---- pure ------------------------------------------------------------------------------------
def img(name: str, size: int, last_used: float, in_use: bool = False) -> TaskImage:
    return TaskImage(f"sha256:{name}", f"tb__{name}__client", size, last_used, in_use)


@pytest.mark.unit
def test_choose_removes_least_recently_used_unused_images_until_within_budget():
    a, b, c = img("a", 40, 1.0), img("b", 30, 2.0), img("c", 30, 3.0)
    live = img("live", 50, 0.5, in_use=True)  # used longest ago, but a container uses it
    assert choose([c, live, b, a], 150) == []  # 150 in all: within
    assert choose([c, live, b, a], 149) == [a]
    assert choose([c, live, b, a], 80) == [a, b]
    assert choose([c, live, b, a], 10) == [a, b, c]  # the live one alone is over: it stays
    assert choose([live], 1) == []


@pytest.mark.unit
def test_choose_breaks_ties_by_id():
    assert choose([img("y", 10, 1.0), img("x", 10, 1.0)], 10) == [img("x", 10, 1.0)]


class FakeDocker:
    """What keep_within asks of the docker SDK: an inspect and removals (409 when in use)."""

    def __init__(self, refused: set, gone: set):
        self.refused, self.gone, self.removed = refused, gone, []
        self.api = SimpleNamespace(inspect_image=self.inspect)
        self.images = SimpleNamespace(remove=self.remove)

    def inspect(self, image_id):
        if image_id in self.gone:
            raise docker.errors.ImageNotFound(image_id)
        return {"RepoTags": [image_id.removeprefix("sha256:") + ":latest"]}

    def remove(self, name):
        if "sha256:" + name.removesuffix(":latest") in self.refused:
            response = requests.Response()
            response.status_code = 409
            raise docker.errors.APIError("conflict: image is being used by stopped container", response=response)
        self.removed.append(name)


@pytest.mark.unit
def test_an_image_refused_or_locked_is_kept_and_the_next_one_goes(monkeypatch, caplog):
    a, b, c, d = img("a", 10, 1.0), img("b", 10, 2.0), img("c", 10, 3.0), img("d", 10, 4.0)
    fake = FakeDocker(refused={a.id}, gone={c.id})
    monkeypatch.setattr(image_budget, "docker_client", lambda: fake)
    monkeypatch.setattr("environments.task_images.docker_client", lambda: fake)
    locks = {b.built_as: FakeLock(free=False)}  # b's build runs now
    forgotten = []

    def lock(image: str) -> FakeLock:
        return locks.setdefault(image, FakeLock(free=True))

    # 40 in all, 15 allowed: a (refused) and b (building) stay, c is already gone (another
    # sweep), so d goes: 20 left, as near as the images in use allow.
    removed = image_budget.keep_within([a, b, c, d], 15, lock, forgotten.append)
    assert removed == [d] and fake.removed == ["d:latest"] and forgotten == [d.built_as]
    [logged] = [r.getMessage() for r in caplog.records if "image budget" in r.getMessage()]
    assert logged == "image budget: removed task image d (d:latest, 0.0 MB, last used 1970-01-01 00:00:04 UTC)"


@pytest.mark.unit
def test_the_budget_setting():
    assert load_settings({}).image_disk_budget == 0
    assert load_settings({"IMAGE_DISK_BUDGET": "50g"}).image_disk_budget == 50 << 30
    with pytest.raises(ValueError, match="IMAGE_DISK_BUDGET must be a size such as 512m or 2g, not 'lots'"):
        load_settings({"IMAGE_DISK_BUDGET": "lots"})


@pytest.mark.unit
def test_image_uses_are_noted_and_forgotten(redis_server):
    redis_server.flushdb()
    store = Store(redis_server)
    store.note_image_use("h1", "tb__a__client", "a", at=10.0)
    store.note_image_use("h1", "tb__a__client", "a", at=20.0)
    store.note_image_use("h1", "tb__b__client", "sha256:" + "b" * 64, at=15.0)
    store.note_image_use("h2", "tb__a__client", "a", at=5.0)
    assert store.image_uses("h1") == {"tb__a__client": 20.0, "tb__b__client": 15.0}
    assert store.image_task("h1", "tb__b__client") == "sha256:" + "b" * 64
    assert store.image_tasks("h1") == {"tb__a__client": "a", "tb__b__client": "sha256:" + "b" * 64}
    store.forget_image_uses("h1", ["tb__a__client"])
    assert store.image_uses("h1") == {"tb__b__client": 15.0} and store.image_task("h1", "tb__a__client") is None
    assert store.image_uses("h2") == {"tb__a__client": 5.0}
