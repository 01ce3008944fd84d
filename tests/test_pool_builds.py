"""One build per pool: two worker hosts (the machine's dockerd and a second one,
tests/second_docker.py) sharing a registry of their own (Debian's docker-registry on a free
port). A task built on one host is pulled, not built, on the other; a changed task is one new
build; two hosts asked at once build once; a registry that is down falls back to a build here;
a task container cannot reach the registry; `dataset prebuild` spreads builds over the hosts."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import docker.errors
import pytest

from devstack import FIXTURES, ROOT, free_port
from environments import pool_images, registry_server
from environments.image_digest import CONTENT_LABEL
from environments.registry import Registry
from poolcore.config import load_registry, load_settings
from poolcore.failures import TaskImageNotFound
from poolcore.queues import make_celery
from poolcore.state import Store
from tests.conftest import Router, wait_for
from tests.second_docker import second_docker, two_host_stack  # noqa: F401 (the fixture)
from tests.test_many_hosts import hosts_cli

SUFFIX = uuid.uuid4().hex[:8]
SHARED = f"pool-shared-{SUFFIX}"  # built on A, pulled on B
RACED = f"pool-raced-{SUFFIX}"  # asked of both hosts at once
OUTAGE = f"pool-outage-{SUFFIX}"  # started while the registry is down
TASKS = (SHARED, RACED, OUTAGE)


def marked(dataset: Path, name: str) -> None:
    """A copy of hello-file whose image holds a marker of its own (a content no other test has)."""
    shutil.copytree(FIXTURES / "hello-file", dataset / name)
    with (dataset / name / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"RUN echo {name}-{uuid.uuid4().hex} > /marker\n")


@pytest.fixture(scope="module")
def registry_cfg(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("pool-registry")
    cfg = load_registry({"REGISTRY_URL": f"127.0.0.1:{free_port()}", "REGISTRY_DATA_DIR": str(data_dir)})
    start_registry(cfg)
    yield cfg
    stop_registry(cfg)


def stop_registry(cfg) -> None:
    pid_file = cfg.data_dir / "registry.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        assert wait_for(lambda: not registry_server.answers(cfg), 20), "the test registry did not stop"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pool-dataset")
    for name in TASKS:
        marked(root, name)
    return root


@pytest.fixture(scope="module")
def pool(second_docker, docker_client, registry_cfg, dataset):  # noqa: F811 (the fixture imported above)
    env = {"REGISTRY_URL": registry_cfg.address, "DATASET_DIR": str(dataset), "WARM_POOL_SIZE": "0"}
    stacks = two_host_stack(second_docker, docker_client, env)
    stack = next(stacks)
    try:
        yield stack
        next(stacks, None)
    finally:
        for client in stack.daemons.values():
            # The listing's own records (images.list() inspects each image afterwards, and
            # another file's teardown may remove one in between); a vanished one is gone already.
            for image in client.api.images(filters={"label": CONTENT_LABEL}):
                if any(task in tag for tag in image.get("RepoTags") or [] for task in TASKS):
                    with contextlib.suppress(docker.errors.NotFound):
                        client.images.remove(image["Id"], force=True)


def start_on(stack, host: str, task: str) -> tuple[str, Router]:
    """A run of `task` reset on `host` (the other drained meanwhile)."""
    other = stack.host_b if host == stack.host_id else stack.host_id
    router = Router(stack)
    hosts_cli(stack, "drain", other)
    try:
        lease = router.allocate(task)
        reply = router.reset(lease, task)
    finally:
        hosts_cli(stack, "undrain", other)
    assert reply.status_code == 200, reply.text
    assert Store(stack.redis).get_run(lease)["host"] == host
    return lease, router


def image_of(stack, host: str, task: str):
    return stack.daemons[host].images.get(f"tb__{task}__client")


def test_a_task_built_on_one_host_is_pulled_on_the_other(pool):
    lease, router = start_on(pool, pool.host_id, SHARED)
    built = image_of(pool, pool.host_id, SHARED)
    assert built.attrs["RepoDigests"], "the build was not pushed to the pool's registry"
    router.close(lease)

    lease, router = start_on(pool, pool.host_b, SHARED)
    pulled = image_of(pool, pool.host_b, SHARED)
    # Not built there: the same image (a build of its own would have another id), with the
    # registry's digest, and the marker of the first build.
    assert pulled.id == built.id
    assert set(pulled.attrs["RepoDigests"]) & set(built.attrs["RepoDigests"])
    assert pulled.labels[CONTENT_LABEL] == built.labels[CONTENT_LABEL]
    assert router.sh(lease, "cat /marker").startswith(SHARED)
    router.close(lease)


def test_a_changed_task_is_one_new_build_for_the_pool(pool, dataset):
    before = image_of(pool, pool.host_id, SHARED)
    with (dataset / SHARED / "Dockerfile").open("a") as dockerfile:
        dockerfile.write("RUN echo changed > /changed\n")
    lease, router = start_on(pool, pool.host_b, SHARED)
    assert router.sh(lease, "cat /changed").strip() == "changed"
    rebuilt = image_of(pool, pool.host_b, SHARED)
    assert rebuilt.labels[CONTENT_LABEL] != before.labels[CONTENT_LABEL]
    router.close(lease)
    lease, router = start_on(pool, pool.host_id, SHARED)
    assert image_of(pool, pool.host_id, SHARED).id == rebuilt.id  # pulled from B's push, not built
    router.close(lease)


def test_two_hosts_asked_at_once_build_once(pool):
    """Both hosts' build queues get the same new task at the same moment: one builds and
    pushes, the other waits on the pool-wide lock and pulls."""
    celery = make_celery(load_settings(pool.env))
    batch = uuid.uuid4().hex
    for host in (pool.host_id, pool.host_b):
        kwargs = dict(host=host, batch=batch, task_path=RACED, timeout=240)
        celery.send_task("pool.prebuild_task", kwargs=kwargs)
    store = Store(pool.redis)
    assert wait_for(lambda: len(store.prebuild_results(batch)) == 2, 240), store.prebuild_results(batch)
    results = store.prebuild_results(batch)
    assert sorted(r["status"] for r in results.values()) == ["built", "pulled"], results
    assert image_of(pool, pool.host_id, RACED).id == image_of(pool, pool.host_b, RACED).id


def test_a_registry_outage_falls_back_to_a_build_here(pool, registry_cfg):
    """The run succeeds (built here), /status says the registry is unreachable from that host,
    and once it is back the host's reconcile pushes what the build could not."""
    stop_registry(registry_cfg)
    try:
        lease, router = start_on(pool, pool.host_b, OUTAGE)
        assert router.sh(lease, "cat /marker").startswith(OUTAGE)
        assert not image_of(pool, pool.host_b, OUTAGE).attrs["RepoDigests"]  # built here, not pushed
        router.close(lease)
        seen = pool.get("/status").json()["pool"]["hosts"][pool.host_b]["registry"]
        assert seen["state"] == "unreachable" and registry_cfg.address in seen["detail"], seen
    finally:
        start_registry(registry_cfg)
    make_celery(load_settings(pool.env)).send_task("pool.reconcile", kwargs={"host": pool.host_b})
    pushed = lambda: image_of(pool, pool.host_b, OUTAGE).attrs["RepoDigests"]  # noqa: E731
    assert wait_for(pushed, 120), "the reconcile did not push the image built during the outage"
    seen = pool.get("/status").json()["pool"]["hosts"][pool.host_b]["registry"]
    assert seen["state"] == "reachable", seen


def start_registry(cfg) -> None:
    registry_server.ensure_running(cfg, listen=f"0.0.0.0:{cfg.address.rpartition(':')[2]}")


def test_a_task_container_cannot_reach_the_registry(pool, registry_cfg):
    """The registry listens on every address of the host; from a run, through its gateway and
    the host's own address, its port is refused (containment denies the host's ports)."""
    lease, router = start_on(pool, pool.host_id, SHARED)
    port = registry_cfg.address.rpartition(":")[2]
    probe = (
        "gw=$(ip route 2>/dev/null | awk '/default/ {print $3}'); "
        '[ -n "$gw" ] || gw=$(awk \'NR>1 && $2=="00000000" {h=$3; printf "%d.%d.%d.%d", '
        '"0x" substr(h,7,2), "0x" substr(h,5,2), "0x" substr(h,3,2), "0x" substr(h,1,2)}\' /proc/net/route); '
        f'if timeout 5 bash -c "exec 3<>/dev/tcp/$gw/{port}" 2>/dev/null; then echo open; else echo refused; fi'
    )
    assert router.sh(lease, probe).strip() == "refused"
    router.close(lease)


def test_prebuild_spreads_the_dataset_over_the_hosts(pool, dataset):
    names = [f"pool-pre{i}-{SUFFIX}" for i in range(4)]
    for name in names:
        marked(dataset, name)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "app", "dataset", "prebuild", "--hosts", "all", "--json"],
            cwd=ROOT,
            env=pool.env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr + result.stdout
        report = json.loads(result.stdout)
        mine = [row for row in report["tasks"] if row["task"] in names]
        built = [row for row in mine if row["status"] == "built"]
        assert len(built) == len(names), mine  # each built once in the pool
        assert {row["host"] for row in built} == {pool.host_id, pool.host_b}  # spread over both
        pulled = [row for row in mine if row["status"] == "pulled"]
        assert len(pulled) == len(names)  # then taken by the host that did not build it
        for name in names:
            assert image_of(pool, pool.host_id, name).id == image_of(pool, pool.host_b, name).id
    finally:
        for name in names:
            for client in pool.daemons.values():
                try:
                    client.images.remove(f"tb__{name}__client", force=True)
                except Exception:
                    pass
            shutil.rmtree(dataset / name, ignore_errors=True)


# ---- images a task names: fetched once for the pool (in this process, this machine's daemon) ---
@pytest.fixture
def upstream(tmp_path):
    """A second registry standing for an image's own (Docker Hub, a vendor's)."""
    cfg = load_registry({"REGISTRY_URL": f"127.0.0.1:{free_port()}", "REGISTRY_DATA_DIR": str(tmp_path / "upstream")})
    registry_server.ensure_running(cfg)
    yield cfg
    stop_registry(cfg)


def test_an_image_a_task_names_is_fetched_once_for_the_pool(
    registry_cfg, upstream, docker_client, base_image, redis_server
):
    image = f"{upstream.address}/vendor/tool-{SUFFIX}:1"
    docker_client.images.build(
        fileobj=io.BytesIO(f"FROM {base_image}\nRUN echo upstream > /origin\n".encode()), tag=image, rm=True
    )
    cfg = load_settings({"REGISTRY_URL": registry_cfg.address, "TBENCH_DOCKER_IMAGE_SOURCE": "pull"})
    store = Store(redis_server)
    try:
        assert Registry(upstream).push(docker_client, image, image)  # what the vendor published
        docker_client.images.remove(image, force=True)
        assert pool_images.fetch_named(cfg, image, 60, store) == "pulled"  # from upstream, copied into the pool's
        mirror = Registry(registry_cfg).remote_ref(image)
        assert Registry(registry_cfg).has(mirror)
        docker_client.images.remove(image, force=True)
        stop_registry(upstream)  # the upstream is gone: the pool's copy serves
        assert pool_images.fetch_named(cfg, image, 60, store) == "pulled"
        assert docker_client.images.get(image).attrs["RepoDigests"]
    finally:
        for name in (image, Registry(registry_cfg).remote_ref(image)):
            try:
                docker_client.images.remove(name, force=True)
            except docker.errors.ImageNotFound:
                pass


def test_an_image_that_exists_nowhere_is_a_task_error_naming_it(registry_cfg, upstream, redis_server):
    cfg = load_settings({"REGISTRY_URL": registry_cfg.address, "TBENCH_DOCKER_IMAGE_SOURCE": "pull"})
    image = f"{upstream.address}/vendor/never-published-{SUFFIX}:1"
    with pytest.raises(TaskImageNotFound, match=re.escape(image)) as refused:
        pool_images.fetch_named(cfg, image, 60, Store(redis_server))
    assert refused.value.code == "TASK_IMAGE_NOT_FOUND"
