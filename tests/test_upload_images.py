"""The reconcile removes the images of uploaded tasks whose upload expired
(tasks/task_folders.remove_expired_images): each new upload is a new image, so a host running
generated tasks would otherwise keep one per task. Real images on this dockerd (tiny, built
FROM the test base image, labelled as termpool's builds label them) and a real redis-server."""

from __future__ import annotations

import io
import uuid

import docker.errors
import pytest

from environments import task_images
from environments.compose_config import client_image
from poolcore import uploaded_tasks
from poolcore.config import load_settings
from poolcore.state import Store
from tasks import task_folders
from tests.test_task_images import exists as present

HOST = "up" + uuid.uuid4().hex[:8]


def task_path(n: int) -> str:
    return uploaded_tasks.PREFIX + (HOST + str(n)).encode().hex().ljust(64, "0")[:64]


def build(docker_client, base_image, path: str, service: str = "client") -> str:
    """An image as a build of the uploaded task makes it: its name, the host's labels."""
    image = client_image(uploaded_tasks.folder_name(path), load_settings({}))
    name = image if service == "client" else image.replace("__client", f"__{service}")
    dockerfile = f"FROM {base_image}\nLABEL soak.test={service}\n".encode()
    docker_client.images.build(
        fileobj=io.BytesIO(dockerfile), tag=name, labels=task_images.build_labels(HOST, image), rm=True
    )
    return name


@pytest.fixture
def store(redis_server, monkeypatch):
    store = Store(redis_server)
    monkeypatch.setattr(task_folders, "store", lambda: store)
    monkeypatch.setattr(task_folders, "settings", lambda: load_settings({}))
    return store


def test_expired_uploads_lose_their_images_and_the_rest_keep_them(store, docker_client, base_image):
    expired, live, stored, used = (task_path(n) for n in range(4))
    images = {path: build(docker_client, base_image, path) for path in (expired, live, stored, used)}
    sidecar = build(docker_client, base_image, expired, "side")
    for path in images:
        store.mark_image_ready(HOST, path)
    store.mark_image_ready(HOST, "hello-file")  # a dataset task: never the reconcile's to remove
    store.put_blob(uploaded_tasks.blob_id(stored), b"archive", 60)
    container = docker_client.containers.create(images[used], ["true"], labels={"termpool.host": HOST})
    try:
        assert task_folders.remove_expired_images(HOST, {live}) == [expired]
        assert not present(docker_client, images[expired]) and not present(docker_client, sidecar)
        assert all(present(docker_client, images[p]) for p in (live, stored, used))
        assert store.ready_images(HOST) == {live, stored, used, "hello-file"}
        container.remove()
        assert task_folders.remove_expired_images(HOST, {live}) == [used]  # no container uses it now
        assert store.ready_images(HOST) == {live, stored, "hello-file"}
    finally:
        for name in [*images.values(), sidecar]:
            try:
                docker_client.images.remove(name, force=True)
            except docker.errors.ImageNotFound:
                pass
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
