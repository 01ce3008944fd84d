"""Task images a rebuild replaces (a dataset update: the same name, a new image) are removed by
their host's reconcile once nothing uses them; never a tagged image, one a live run's container
uses, or a fork's committed image. A private stack over a temporary dataset whose tasks have
names of their own: other test sessions on this dockerd never see these images change."""

from __future__ import annotations

import functools
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
import requests

from devstack import FIXTURES
from environments import container_spec, forking, task_images
from environments.docker_client import TASK_IMAGE_LABEL, TASK_IMAGE_LOCK_LABEL
from environments.image_digest import CONTENT_LABEL
from poolcore.config import load_settings
from poolcore.queues import make_celery
from poolcore.state import Store
from tests.conftest import Router, private_stack, wait_for

SUFFIX = uuid.uuid4().hex[:8]
ONE = f"prune-one-{SUFFIX}"  # hello-file: one service, built through the SDK
KV = f"prune-kv-{SUFFIX}"  # sidecar-kv: two services, built by compose
FORKED = f"prune-fork-{SUFFIX}"  # hello-file again, for the fork
STALE = f"prune-stale-{SUFFIX}"  # hello-file, changed between two starts


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    shutil.copytree(FIXTURES / "hello-file", root / ONE)
    shutil.copytree(FIXTURES / "sidecar-kv", root / KV)
    shutil.copytree(FIXTURES / "hello-file", root / FORKED)
    shutil.copytree(FIXTURES / "hello-file", root / STALE)
    return root


@pytest.fixture(scope="module")
def pruned(base_image, docker_client, dataset):
    # No warm spares: a spare of the old image would keep it in use (rightly) until it goes.
    env = {"DATASET_DIR": str(dataset), "WARM_POOL_SIZE": "0"}
    names = [f"tb__{ONE}__client", f"tb__{KV}__client", f"tb__{KV}__kv", f"tb__{FORKED}__client"]
    names.append(f"tb__{STALE}__client")
    yield from labelled_stack(docker_client, env, names)


def labelled_stack(docker_client, env: dict, names: list[str]):
    """A private stack (`yield from`), and once it stopped the images its tests made: `names`
    and whatever its host labelled."""
    stacks = private_stack(docker_client, env)
    stack = next(stacks)
    try:
        yield stack
        next(stacks, None)  # stops it, checking that it left no container
    finally:
        _remove_images(docker_client, stack.host_id, names)


def _remove_images(docker_client, host: str, names: list[str]) -> None:
    labelled = docker_client.images.list(all=True, filters={"label": f"{TASK_IMAGE_LABEL}={host}"})
    for image in [*names, *(image.id for image in labelled)]:
        try:
            docker_client.images.remove(image, force=True)
        except docker.errors.ImageNotFound:
            pass


def exists(docker_client, image_id: str) -> bool:
    try:
        docker_client.images.get(image_id)
        return True
    except docker.errors.ImageNotFound:
        return False


def started(router: Router, task: str) -> str:
    lease = router.allocate(task)
    reply = router.reset(lease, task)
    assert reply.status_code == 200, reply.text
    return lease


def closed(router: Router, docker_client, lease: str) -> None:
    router.close(lease)
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60), f"{lease} was not torn down"


def changed(task_dir: Path) -> None:
    """A dataset update: the Dockerfile now gives another image (under the same name)."""
    with (task_dir / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"ENV TERMPOOL_TEST_REBUILD={uuid.uuid4().hex}\n")


def rebuilt(router: Router, docker_client, dataset: Path, task: str) -> str:
    """A dataset update of a one-service task while its image is in use: its Dockerfile changed
    and its name taken off (forced: a run's container or a fork's committed image uses the
    image, which stays, untagged), so the next start builds it again. That start's lease."""
    tag = f"tb__{task}__client"
    old = docker_client.images.get(tag).id
    changed(dataset / task)
    docker_client.images.remove(tag, force=True)
    lease = started(router, task)
    assert docker_client.images.get(tag).id != old
    return lease


def reconcile(stack) -> None:
    """The host's reconcile, as beat sends it (no result comes back: watch what it does)."""
    make_celery(load_settings(stack.env)).send_task("pool.reconcile", kwargs={"host": stack.host_id})


def sweep_now(stack) -> list[str]:
    """The reconcile's image step, run here: what it removed, once it has."""
    return task_images.remove_unused(stack.host_id, functools.partial(Store(stack.redis).build_lock, stack.host_id))


# ---- with dockerd ---------------------------------------------------------------------------
def test_a_rebuilt_sidecar_image_is_removed_by_the_reconcile(pruned, docker_client, dataset):
    """Compose build: each image carries the host's labels; the one a rebuild replaced goes."""
    router = Router(pruned)
    client_tag, kv_tag = f"tb__{KV}__client", f"tb__{KV}__kv"
    closed(router, docker_client, started(router, KV))
    old = docker_client.images.get(kv_tag)
    for image in (old, docker_client.images.get(client_tag)):
        assert image.labels[TASK_IMAGE_LABEL] == pruned.host_id
        assert image.labels[TASK_IMAGE_LOCK_LABEL] == client_tag  # the lock its whole build held

    changed(dataset / KV / "kv")
    # The agent's image gone (nothing uses it): the next start builds the task's images again.
    docker_client.images.remove(client_tag)
    lease = started(router, KV)
    assert docker_client.images.get(kv_tag).id != old.id
    assert docker_client.images.get(old.id).tags == []  # dangling: what used to pile up

    reconcile(pruned)
    assert wait_for(lambda: not exists(docker_client, old.id), 60), "the replaced image was not removed"
    assert docker_client.images.get(kv_tag) and docker_client.images.get(client_tag)
    assert router.sh(lease, "echo still-here").strip() == "still-here"
    closed(router, docker_client, lease)


def test_a_changed_task_is_built_again_not_served_its_old_image(pruned, docker_client, dataset):
    """A dataset update with the old image still tagged: the next start sees the task's content
    digest differ from its image's, builds again, and serves the new image; an unchanged task
    is not built again."""
    router = Router(pruned)
    tag = f"tb__{STALE}__client"
    closed(router, docker_client, started(router, STALE))
    old = docker_client.images.get(tag)
    assert old.labels[CONTENT_LABEL]
    marker = uuid.uuid4().hex
    with (dataset / STALE / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"RUN echo {marker} > /marker\n")
    lease = started(router, STALE)
    assert router.sh(lease, "cat /marker").strip() == marker
    new = docker_client.images.get(tag)
    assert new.id != old.id and new.labels[CONTENT_LABEL] != old.labels[CONTENT_LABEL]
    closed(router, docker_client, lease)
    closed(router, docker_client, started(router, STALE))
    assert docker_client.images.get(tag).id == new.id  # unchanged: not built again


def test_an_image_a_live_run_uses_is_kept_until_the_run_closes(pruned, docker_client, dataset):
    """The SDK build: the replaced image stays while the run started from it lives; once that
    run is closed, the next reconcile removes it."""
    router = Router(pruned)
    tag = f"tb__{ONE}__client"
    first = started(router, ONE)
    old = docker_client.images.get(tag)
    assert old.labels[TASK_IMAGE_LABEL] == pruned.host_id and old.labels[TASK_IMAGE_LOCK_LABEL] == tag
    second = rebuilt(router, docker_client, dataset, ONE)
    assert docker_client.images.get(old.id).tags == []

    assert old.id.removeprefix("sha256:")[:12] not in sweep_now(pruned)
    assert exists(docker_client, old.id), "the image of a live run's container was removed"
    assert router.sh(first, "echo alive").strip() == "alive"

    closed(router, docker_client, first)
    reconcile(pruned)
    assert wait_for(lambda: not exists(docker_client, old.id), 60), "the replaced image was not removed"
    assert docker_client.images.get(tag), "the image the next runs start from was removed"
    assert router.sh(second, "echo ok").strip() == "ok"
    closed(router, docker_client, second)


def test_a_fork_outlives_its_source_and_the_rebuild(pruned, docker_client, dataset):
    """A fork's committed image (it carries its task image's labels) and its child survive the
    sweep after the source closed and the task image was replaced; nothing is left after."""
    router = Router(pruned)
    source = started(router, FORKED)
    old = docker_client.images.get(f"tb__{FORKED}__client")
    router.sh(source, "echo from-source > /app/carried.txt")
    [child] = router.pool.lease(source).fork(1)
    [committed] = [name for name in forking.host_images(pruned.host_id) if name.split(":", 1)[1].startswith(source)]
    assert docker_client.images.get(committed).labels[TASK_IMAGE_LABEL] == pruned.host_id
    closed(router, docker_client, source)
    closed(router, docker_client, rebuilt(router, docker_client, dataset, FORKED))

    sweep_now(pruned)  # the old image stays only if dockerd ties it to the committed one (graphdriver)
    assert docker_client.images.get(committed), "a fork's committed image was removed"
    assert router.sh(child.id, "cat /app/carried.txt").strip() == "from-source"

    closed(router, docker_client, child.id)
    assert wait_for(lambda: committed not in forking.host_images(pruned.host_id), 60)
    reconcile(pruned)
    assert wait_for(lambda: not exists(docker_client, old.id), 60), "the replaced image was not removed"


# ---- pure ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_build_override_labels_each_image_it_builds(tmp_path):
    cfg = load_settings({"POOL_HOST_ID": "h1", "TBENCH_OUTPUT_ROOT": str(tmp_path)})
    resolved = {
        "name": "tb__t",
        "services": {
            "client": {"build": {"context": "."}, "image": "tb__t__client"},
            "side": {"build": {"context": "./side"}},
            "db": {"image": "redis:7"},
        },
    }
    labels = task_images.build_labels("h1", "tb__t__client")
    services = container_spec.run_override(resolved, "t", labels, "", [], cfg, 0)["services"]
    assert services == {
        "client": {"build": {"labels": labels}},
        "side": {"image": "tb__t__side", "build": {"labels": labels}},
        "db": {},  # pulled, never built: no build key, or compose would try to build it
    }
    assert labels == {TASK_IMAGE_LABEL: "h1", TASK_IMAGE_LOCK_LABEL: "tb__t__client"}


class FakeLock:
    def __init__(self, free: bool):
        self.free = free

    def acquire(self) -> bool:
        return self.free

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free = True


def listed(digit: str, built_as: str, **labels) -> dict:
    """An image as the Engine API's listing gives it."""
    return {"Id": "sha256:" + digit * 64, "Labels": {TASK_IMAGE_LABEL: "h1", TASK_IMAGE_LOCK_LABEL: built_as, **labels}}


class FakeDocker:
    """What remove_unused asks of the docker SDK: a listing, an inspect, a removal (409 when in use)."""

    def __init__(self, listing: list, tagged: set, in_use: set):
        self.listing, self.tagged, self.in_use, self.removed = listing, tagged, in_use, []
        self.api = SimpleNamespace(images=self.list, inspect_image=self.inspect)
        self.images = SimpleNamespace(remove=self.remove)

    def list(self, filters):
        assert filters == {"dangling": True, "label": f"{TASK_IMAGE_LABEL}=h1"}
        return self.listing

    def inspect(self, image_id):
        return {"RepoTags": ["tb__t__client:latest"] if image_id in self.tagged else []}

    def remove(self, image_id):
        if image_id in self.in_use:
            response = requests.Response()
            response.status_code = 409
            raise docker.errors.APIError("conflict: image is being used by running container", response=response)
        self.removed.append(image_id)


@pytest.mark.unit
def test_only_untagged_unused_images_outside_a_build_are_removed(monkeypatch):
    images = [
        listed("a", "tb__a__client"),  # unused: removed
        listed("b", "tb__building__client"),  # its build holds the lock: the next sweep
        listed("c", "tb__c__client"),  # tagged again since the listing
        listed("d", "tb__d__client"),  # a container uses it
        listed("e", "tb__e__client", **{forking.FORK_LABEL: "run-1"}),  # a fork's (it inherits the labels)
    ]
    fake = FakeDocker(images, tagged={images[2]["Id"]}, in_use={images[3]["Id"]})
    monkeypatch.setattr(task_images, "docker_client", lambda: fake)
    locks = {}

    def build_lock(image: str) -> FakeLock:
        return locks.setdefault(image, FakeLock(free=image != "tb__building__client"))

    assert task_images.remove_unused("h1", build_lock) == ["a" * 12]
    assert fake.removed == [images[0]["Id"]]
    assert set(locks) == {"tb__a__client", "tb__building__client", "tb__c__client", "tb__d__client"}
