"""Tasks sent by the client (POST /v1/tasks) on a real pool of two worker hosts (the stack's on
the machine's dockerd, a second host's on a second dockerd, tests/second_docker.py), each with a
task-folder cache of its own: uploads of each format and whole episodes through the client,
content stored once, a digest built once per host, a host that never saw the folder, the
refusals (each leaving nothing in Redis) and an unknown or expired digest refused before a slot
is taken."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import shutil
import tarfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from devstack import FIXTURES, ROOT, Stack
from poolcore import uploaded_tasks
from poolcore.state import Store, blob_key
from termpool.client import AsyncPool, TaskHasNoTests, UnknownTask
from termpool.client.task_tar import folder_archive
from tests.conftest import wait_for
from tests.second_docker import second_docker, two_host_stack  # noqa: F401 (the fixture)
from tests.test_many_hosts import hosts_cli
from tests.test_task_archive import tar

HARBOR = ROOT / "tests" / "fixtures" / "harbor"
BASE = "termpool-test-base:bookworm"
MAX_BYTES, MAX_FILES = 4 << 20, 200  # small limits: a 413 needs no large body
STACK_ENV = {
    "UPLOADED_TASK_MAX_BYTES": str(MAX_BYTES),
    "UPLOADED_TASK_MAX_FILES": str(MAX_FILES),
    "WARM_POOL_SIZE": "1",
}


@pytest.fixture(scope="module")
def pool(second_docker, docker_client):  # noqa: F811 (the fixture imported above)
    yield from two_host_stack(second_docker, docker_client, STACK_ENV)


def post_raw(stack: Stack, path: str, body: bytes) -> requests.Response:
    return requests.post(stack.url + path, data=body, headers={"Content-Type": "application/gzip"}, timeout=120)


def store(stack: Stack) -> Store:
    return Store(stack.redis)


def cache_dir(stack: Stack, host: str) -> Path:
    env = stack.env if host == stack.host_id else stack.extra_hosts[host]
    return Path(env["UPLOADED_TASKS_DIR"])


def blob_keys(stack: Stack) -> set[str]:
    return set(stack.redis.scan_iter(blob_key("*")))


@contextlib.contextmanager
def only_on(stack: Stack, host: str):
    """Placement has this one host to choose while the block runs."""
    others = [h for h in (stack.host_id, stack.host_b) if h != host]
    for other in others:
        hosts_cli(stack, "drain", other)
    try:
        yield
    finally:
        for other in others:
            hosts_cli(stack, "undrain", other)


def bare_environment(folder: Path, marker: str) -> Path:
    """A bare Harbor environment whose image holds `marker` in /marker."""
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text(f"FROM {BASE}\nRUN echo {marker} > /marker\nWORKDIR /app\n")
    (folder / "task.toml").write_text("[environment]\ncpus = 1\nmemory_mb = 512\n")
    return folder


def with_marker(source: Path, folder: Path, marker: str) -> Path:
    """A copy of a fixture task with one more file: new content, so a new digest."""
    shutil.copytree(source, folder)
    (folder / "marker.txt").write_text(marker)
    return folder


# ---- uploads --------------------------------------------------------------------------------
def test_same_content_twice_is_stored_once(pool):
    body = folder_archive(FIXTURES / "hello-file")
    before = blob_keys(pool)
    first = post_raw(pool, "/v1/tasks", body)
    second = post_raw(pool, "/v1/tasks", tar_again(body))
    assert (first.status_code, second.status_code) == (201, 200), (first.text, second.text)
    assert first.json()["created"] is True and second.json()["created"] is False
    assert first.json()["task_path"] == second.json()["task_path"] == pool.client.upload_task(FIXTURES / "hello-file")
    assert first.json()["kind"] == "terminal-bench" and first.json()["expires_in"] == 3 * 24 * 3600
    added = blob_keys(pool) - before
    path = first.json()["task_path"]
    assert added <= {blob_key(uploaded_tasks.blob_id(path))} and pool.redis.exists(
        blob_key(uploaded_tasks.blob_id(path))
    )


def tar_again(body: bytes) -> bytes:
    """The same folder packed otherwise: plain tar, entries in reverse order, other mtimes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(body))) as src, tarfile.open(fileobj=raw, mode="w:") as out:
        for member in reversed(src.getmembers()):
            member.mtime, member.uname = 12345, "someone"
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
    return raw.getvalue()


def _bad_archives(tmp_path: Path) -> list[tuple[str, bytes, int, str, str]]:
    not_a_task = tmp_path / "not-a-task"
    not_a_task.mkdir()
    (not_a_task / "README.md").write_text("hello")
    bad_yaml = with_marker(FIXTURES / "hello-file", tmp_path / "bad-yaml", "x")
    (bad_yaml / "task.yaml").write_text("instruction: [\n")
    return [
        ("garbage", b"this is not an archive" * 50, 400, "TASK_ARCHIVE_INVALID", "not a readable tar"),
        ("dot-dot", tar(("../escape", "file", b"x")), 400, "TASK_ARCHIVE_INVALID", "'..'"),
        ("absolute", tar(("/etc/cron.d/x", "file", b"x")), 400, "TASK_ARCHIVE_INVALID", "absolute"),
        (
            "link out",
            tar(("task.yaml", "file", b"instruction: x"), ("l", "symlink", "../../etc")),
            400,
            "TASK_ARCHIVE_INVALID",
            "leaves the folder",
        ),
        ("hard link", tar(("a", "file", b"x"), ("b", "hardlink", "a")), 400, "TASK_ARCHIVE_INVALID", "hard links"),
        ("fifo", tar(("p", "fifo", None)), 400, "TASK_ARCHIVE_INVALID", "fifos"),
        ("not a task", folder_archive(not_a_task), 400, "TASK_ARCHIVE_INVALID", "not a task"),
        ("reader refuses", folder_archive(bad_yaml), 400, "TASK_ARCHIVE_INVALID", "invalid YAML"),
        ("bomb", gzip.compress(b"\0" * (2 * MAX_BYTES)), 413, "TASK_ARCHIVE_TOO_LARGE", "unpacks to more"),
        ("big body", b"\0" * (2 * MAX_BYTES), 413, "TASK_ARCHIVE_TOO_LARGE", "larger than"),
        (
            "many files",
            tar(*[(f"f{i}", "file", b"") for i in range(MAX_FILES + 1)]),
            413,
            "TASK_ARCHIVE_TOO_LARGE",
            "UPLOADED_TASK_MAX_FILES",
        ),
        (
            "big files",
            tar(("a", "file", b"x" * (MAX_BYTES + 1))),
            413,
            "TASK_ARCHIVE_TOO_LARGE",
            "UPLOADED_TASK_MAX_BYTES",
        ),
    ]


def test_bad_archives_are_refused_and_store_nothing(pool, tmp_path):
    before = blob_keys(pool)
    for name, body, status, code, text in _bad_archives(tmp_path):
        reply = post_raw(pool, "/v1/tasks", body)
        assert reply.status_code == status, (name, reply.text)
        assert reply.json()["code"] == code and text in reply.json()["error"], (name, reply.json())
        assert blob_keys(pool) == before, name


# ---- episodes of each format ------------------------------------------------------------------
def test_terminal_bench_task_on_both_faces(pool):
    path = pool.client.upload_task(FIXTURES / "hello-file")
    with pool.client.start("hello-file", task_path=path) as run:  # the runs API
        run.write_file("/tmp/solution.sh", (FIXTURES / "hello-file" / "solution.sh").read_text())
        run.exec("bash /tmp/solution.sh")
        assert run.exec("cat /app/hello.txt").strip() == "Hello, world!"
        assert run.evaluate().score == 1.0
    with pool.client.allocate("hello-file") as lease:  # the pool API
        lease.reset("hello-file", task_path=path)
        assert "hello.txt" not in lease.exec("ls /app")  # a fresh environment
        assert lease.evaluate().score == 0.0


def test_harbor_task_through_the_async_client(pool):
    async def episode():
        async with AsyncPool(pool.url, retries=0, job_timeout=600) as client:
            path = await client.upload_task(HARBOR / "harbor-hello")
            async with await client.start("harbor-hello", task_path=path) as run:
                await run.exec("echo 'Hello, world!' > /app/hello.txt")
                evaluation = await run.evaluate()
            return path, evaluation

    path, evaluation = asyncio.run(episode())
    assert path.startswith("sha256:") and evaluation.score == 1.0


def test_bare_environments_take_tool_calls_not_evaluations(pool, tmp_path):
    """Two environments under one task_name: each run gets its own image (named by the digest)."""
    first = pool.client.upload_task(bare_environment(tmp_path / "one", "first-" + uuid.uuid4().hex))
    second = pool.client.upload_task(bare_environment(tmp_path / "two", "second-" + uuid.uuid4().hex))
    assert first != second
    for path, expected in ((first, "first-"), (second, "second-")):
        with pool.client.start("environment", task_path=path, instruction="explore") as run:
            assert run.exec("cat /marker").startswith(expected)
            assert "Task instruction: explore" in run.user_msg
            with pytest.raises(TaskHasNoTests) as caught:
                run.evaluate()
            assert "no tests" in str(caught.value)
            assert run.exec("cat /marker").startswith(expected)  # the run goes on after the refusal
            assert run.info()["state"] == "ready"


# ---- hosts ------------------------------------------------------------------------------------
def _tag_events(docker_client, image: str, since: int) -> int:
    """How often the daemon tagged `image` since then: once per build."""
    until = int(time.time()) + 1
    events = docker_client.events(since=since, until=until, filters={"type": "image", "event": "tag"}, decode=True)
    return sum(1 for event in events if event.get("Actor", {}).get("Attributes", {}).get("name", "").startswith(image))


def test_a_digest_started_twice_on_a_host_is_built_once(pool, docker_client, tmp_path):
    path = pool.client.upload_task(bare_environment(tmp_path / "env", "once-" + uuid.uuid4().hex))
    image = f"tb__{uploaded_tasks.folder_name(path)}__client"
    since = int(time.time()) - 1
    with only_on(pool, pool.host_id), ThreadPoolExecutor(2) as starts:
        runs = [starts.submit(pool.client.start, "twice", task_path=path, wait=False) for _ in range(2)]
        runs = [future.result() for future in runs]
    for run in runs:
        run.wait_ready()
        assert run.exec("cat /marker").startswith("once-")
        run.close(wait=True)
    assert _tag_events(docker_client, image, since) == 1
    assert store(pool).image_ready(pool.host_id, path)
    folder = cache_dir(pool, pool.host_id)
    assert [p.name for p in folder.iterdir() if path[7:] in p.name] == [uploaded_tasks.folder_name(path)]


def test_a_host_that_never_saw_the_folder_runs_it(pool, tmp_path):
    path = pool.client.upload_task(with_marker(HARBOR / "harbor-hello", tmp_path / "task", uuid.uuid4().hex))
    name = uploaded_tasks.folder_name(path)
    with only_on(pool, pool.host_b):
        run = pool.client.start("harbor-hello", task_path=path)
    with run:
        assert run.info()["host"] == pool.host_b
        run.exec("echo 'Hello, world!' > /app/hello.txt")
        assert run.evaluate().score == 1.0
    assert (cache_dir(pool, pool.host_b) / name / "marker.txt").is_file()
    assert not (cache_dir(pool, pool.host_id) / name).exists()


# ---- unknown and expired digests --------------------------------------------------------------
def test_an_unknown_or_expired_digest_is_refused_before_a_slot(pool):
    unknown = "sha256:" + uuid.uuid4().hex * 2
    live = pool.client.status()["total_active_runs"]
    reply = pool.post("/v1/runs", {"task_meta": {"task_name": "x", "task_path": unknown}})
    assert reply.status_code == 404 and reply.json()["code"] == "UNKNOWN_TASK", reply.text
    assert reply.json()["retryable"] is False and "upload it again" in reply.json()["error"]
    with pool.client.allocate("x") as lease:
        reply = pool.post("/reset", {"lease_id": lease.id, "task_meta": {"task_name": "x", "task_path": unknown}})
        assert reply.status_code == 404 and reply.json()["code"] == "UNKNOWN_TASK", reply.text
    malformed = pool.post("/v1/runs", {"task_meta": {"task_name": "x", "task_path": "sha256:ABC"}})
    assert malformed.status_code == 400 and "64 lowercase hex" in malformed.json()["error"]
    assert wait_for(lambda: pool.client.status()["total_active_runs"] == live, 30)

    path = pool.client.upload_task(FIXTURES / "hello-file")
    key = blob_key(uploaded_tasks.blob_id(path))
    pool.redis.pexpire(key, 60_000)  # nearly expired: a run that names it starts its lifetime again
    with pool.client.start("hello-file", task_path=path) as run:
        assert pool.redis.pttl(key) > 3 * 24 * 3600 * 1000 - 60_000
        run.exec("true")
    pool.redis.delete(key)  # expired
    with pytest.raises(UnknownTask):
        pool.client.start("hello-file", task_path=path)
    assert wait_for(lambda: pool.client.status()["total_active_runs"] == live, 30)
    pool.client.upload_task(FIXTURES / "hello-file")  # stored again, for any later test


def test_placement_knows_an_uploaded_task_pins_a_subnet(pool):
    """What the upload read of its compose file (a fixed subnet) places it as a dataset task:
    one live run per host, a third refused with the reason. Keyed by its digest, no start."""
    path = pool.client.upload_task(FIXTURES / "compose-fixed-subnet")
    leases = [pool.client.allocate(path) for _ in range(2)]
    try:
        assert {store(pool).get_run(lease.id)["host"] for lease in leases} == {pool.host_id, pool.host_b}
        reply = pool.post("/allocate", {"task_key": path})
        assert reply.status_code == 429 and "fixed subnet 10.231.0.0/24" in reply.json()["error"], reply.text
    finally:
        for lease in leases:
            lease.close()
