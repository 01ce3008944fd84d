"""A tenant's build and upload quotas on a real stack, over HTTP (docs/tenants.md, "Quotas"):
an upload over max_upload_bytes is a 429 that stores nothing, racing uploads never pass it, and
a start that must build while the tenant's max_builds are in flight (real builds: slow-build's
RUN sleep) is refused TENANT_QUOTA_EXCEEDED while a start whose images are present is not."""

from __future__ import annotations

import shutil
import threading
import uuid

import pytest
import requests

from devstack import FIXTURES
from poolcore import uploaded_tasks
from poolcore.config import load_settings
from poolcore.state import Store, keys
from termpool.client.task_tar import folder_archive
from tests.conftest import private_stack, wait_for

ADMIN = "admin-token-0000"
BUILDER, UPLOADER, RACER = "tenant-build-token-1111", "tenant-upload-token-2222", "tenant-race-token-3333"
TAR = {"Content-Type": "application/x-tar"}
NONCE = 32  # characters of every copy's nonce: copies of one task are the same size


def copy_of(task: str, tmp_path_factory) -> bytes:
    """A task folder of its own (a fresh nonce: its own digest, its own images), as an archive."""
    folder = tmp_path_factory.mktemp("task") / task
    shutil.copytree(FIXTURES / task, folder)
    (folder / "nonce").write_text(uuid.uuid4().hex[:NONCE])
    return folder_archive(folder)


def size_of(archive: bytes) -> int:
    return uploaded_tasks.accept(archive, load_settings({}).uploaded_task_limits).size


@pytest.fixture(scope="module")
def pool(docker_client, tmp_path_factory):
    one = size_of(copy_of("hello-file", tmp_path_factory))
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(
        "tenants:\n"
        f"  builder: {{token: {BUILDER}, max_builds: 1}}\n"
        f"  uploader: {{token: {UPLOADER}, max_upload_bytes: {one + one // 2}}}\n"
        f"  racer: {{token: {RACER}, max_upload_bytes: {3 * one}}}\n"
    )
    env = {"POOL_API_TOKEN": ADMIN, "TENANTS_FILE": str(path), "BUILD_CONCURRENCY": "2"}
    yield from private_stack(docker_client, env)


def call(stack, token: str, method: str, path: str, body=None, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
    json_body = {"json": body} if "data" not in kw else {}
    return requests.request(method, stack.url + path, headers=headers, timeout=600, **json_body, **kw)


def quotas(stack, token: str) -> dict:
    return call(stack, token, "GET", "/status").json()["pool"]["tenant"]["quotas"]


def refused(reply: requests.Response, limit: str) -> None:
    assert reply.status_code == 429, reply.text
    body = reply.json()
    assert body["code"] == "TENANT_QUOTA_EXCEEDED" and body["retryable"] is True, body
    assert limit in body["error"], body


def test_an_upload_over_max_upload_bytes_stores_nothing(pool, tmp_path_factory):
    first, second = copy_of("hello-file", tmp_path_factory), copy_of("hello-file", tmp_path_factory)
    size = size_of(first)
    stored = call(pool, UPLOADER, "POST", "/v1/tasks", data=first, headers=TAR)
    assert stored.status_code == 201, stored.text
    again = call(pool, UPLOADER, "POST", "/v1/tasks", data=first, headers=TAR)  # the same task: counted once
    assert again.status_code == 200, again.text
    assert quotas(pool, UPLOADER)["upload_bytes"] == {"used": size, "max": size + size // 2}
    over = call(pool, UPLOADER, "POST", "/v1/tasks", data=second, headers=TAR)
    refused(over, "max_upload_bytes")
    task_path = uploaded_tasks.accept(second, load_settings({}).uploaded_task_limits).task_path
    assert not pool.redis.exists(keys.blob_key(uploaded_tasks.blob_id(task_path)))  # nothing stored
    assert not pool.redis.exists(keys.blob_key(uploaded_tasks.facts_id(task_path)))
    meta = {"task_name": "hello-file", "task_path": task_path, "instruction": "x"}
    unknown = call(pool, UPLOADER, "POST", "/v1/runs", {"task_meta": meta})
    assert unknown.status_code == 404 and unknown.json()["code"] == "UNKNOWN_TASK", unknown.text
    assert quotas(pool, UPLOADER)["upload_bytes"]["used"] == size
    operator = call(pool, ADMIN, "POST", "/v1/tasks", data=second, headers=TAR)  # the operator has no quota
    assert operator.status_code == 201, operator.text


def test_racing_uploads_never_pass_max_upload_bytes(pool, tmp_path_factory):
    archives = [copy_of("hello-file", tmp_path_factory) for _ in range(8)]
    replies: list[requests.Response] = []
    threads = [
        threading.Thread(target=lambda a=a: replies.append(call(pool, RACER, "POST", "/v1/tasks", data=a, headers=TAR)))
        for a in archives
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.status_code for r in replies) == [201] * 3 + [429] * 5, [r.text for r in replies]
    assert quotas(pool, RACER)["upload_bytes"]["used"] == 3 * size_of(archives[0])


def reset(stack, lease: str, task_path: str) -> requests.Response:
    meta = {"task_name": "slow-build", "task_path": task_path, "instruction": "x"}
    return call(stack, BUILDER, "POST", "/reset", {"lease_id": lease, "task_meta": meta})


def upload(stack, archive: bytes) -> str:
    reply = call(stack, BUILDER, "POST", "/v1/tasks", data=archive, headers=TAR)
    assert reply.status_code == 201, reply.text
    return reply.json()["task_path"]


def in_background(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    return thread, out


def test_max_builds_refuses_a_start_that_must_build(pool, tmp_path_factory):
    """max_builds 1: while one start builds (slow-build: RUN sleep 20), another start that must
    build is refused at once; one whose images are present starts; the lease is given back."""
    first, second = (upload(pool, copy_of("slow-build", tmp_path_factory)) for _ in range(2))
    leases = [call(pool, BUILDER, "POST", "/allocate", {"task_key": f"b{i}"}).json()["lease_id"] for i in range(2)]
    try:
        building, done = in_background(reset, pool, leases[0], first)
        assert wait_for(lambda: quotas(pool, BUILDER)["builds"] == {"used": 1, "max": 1}, 120)
        refused(reset(pool, leases[1], second), "max_builds")
        assert building.is_alive()  # refused while the other build ran
        building.join()
        assert done[0].status_code == 200, done[0].text
        assert quotas(pool, BUILDER)["builds"]["used"] == 0  # given back when the build ended
        building, done = in_background(reset, pool, leases[1], second)  # its turn now
        assert wait_for(lambda: quotas(pool, BUILDER)["builds"]["used"] == 1, 120)
        present = reset(pool, leases[0], first)  # its images are built: no build, no quota
        assert present.status_code == 200, present.text
        building.join()
        assert done[0].status_code == 200, done[0].text
        assert quotas(pool, BUILDER)["builds"]["used"] == 0
    finally:
        for lease in leases:
            call(pool, ADMIN, "POST", "/close", {"lease_id": lease})


def test_a_lost_build_keeps_one_lease_and_gives_it_back(pool, tmp_path_factory):
    """The build worker killed mid-build (its whole process group): its lease still counts
    (nothing could give it back); the build sent again after the restart has the same job, so
    its end gives the lease back (one lease per job: tests/test_tenants_usage.py). Started
    through the runs API, which no client waits on (a waiting /reset may fail the job
    WORKERS_DOWN while the build queue is silent; its ended job frees the lease as well)."""
    meta = {"task_name": "slow-build", "task_path": upload(pool, copy_of("slow-build", tmp_path_factory))}
    started = call(pool, BUILDER, "POST", "/v1/runs", {"task_meta": {**meta, "instruction": "x"}, "task_key": "lost"})
    assert started.status_code == 202, started.text
    run_id, job_id = started.json()["run_id"], started.json()["job_id"]
    store = Store(pool.redis)
    try:
        assert wait_for(lambda: quotas(pool, BUILDER)["builds"]["used"] == 1, 120)
        pool.kill("build")
        assert quotas(pool, BUILDER)["builds"]["used"] == 1  # the dead build's lease holds
        pool.start_worker("build")
        assert wait_for(lambda: store.get_job(job_id)["state"] in ("succeeded", "failed"), 300)
        job = store.get_job(job_id)
        assert job["state"] == "succeeded" and job["retry_code"] == "WORKER_LOST", job  # lost, built again
        assert quotas(pool, BUILDER)["builds"]["used"] == 0
    finally:
        call(pool, ADMIN, "DELETE", f"/v1/runs/{run_id}")
