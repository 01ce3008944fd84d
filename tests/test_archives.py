"""Files into and out of a run's container (app/archives_api.py, tasks/archive_jobs.py,
environments/archives.py, termpool/client/archives.py) against the session's real stack
(tests/conftest.py): Redis, dockerd, the Celery workers and the facade over HTTP."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import tarfile

import pytest
import requests

from poolcore.state import PREFIX
from termpool.client import (
    AsyncPool,
    NotADirectory,
    PathNotFound,
    Pool,
    RunClosed,
    TermpoolError,
    UnknownRun,
)
from tests.conftest import make_app

FILE, DIR, SYM, LINK = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
BLOB = f"{PREFIX}blob:*"


# ---- helpers --------------------------------------------------------------------------------
def tar_of(*members, uid: int = 0) -> bytes:
    """(name, tar type, data) members: a file's content, or a link's target."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.uid, info.gid, info.mode = kind, uid, uid, 0o644
            if kind in (SYM, LINK):
                info.linkname = data.decode()
            if kind == FILE:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if kind == FILE else None)
    return buf.getvalue()


def make_tree(root):
    """A folder with a binary file, an executable, a symlink, an empty and nested folders."""
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "blob.bin").write_bytes(bytes(range(256)) * 64 + b"\0\xff\r\n")
    (root / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (root / "run.sh").chmod(0o755)
    (root / "nested" / "deeper" / "note.txt").write_text("deep")
    (root / "nested" / "private").write_text("secret")
    (root / "nested" / "private").chmod(0o600)
    (root / "link").symlink_to("nested/deeper/note.txt")


def tree(root) -> dict:
    """Every entry below root: its kind, permission bits and content (or link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir", stat.S_IMODE(os.stat(path).st_mode))
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(os.stat(path).st_mode), f.read())
    return out


def blobs(stack) -> set:
    return set(stack.redis.scan_iter(BLOB))


def sh(run, command: str) -> str:
    return run.exec(command, timeout=30).strip()


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(stack):
    with Pool(stack.url, backoff=0.5, job_timeout=600) as p:
        yield p


@pytest.fixture(scope="module")
def run(pool):
    with pool.start("hello-file") as r:
        yield r


@pytest.fixture
def small_facade(stack):
    """A facade of the same stack (its Redis and workers) with ARCHIVE_MAX_BYTES at 16 KiB
    (tarfile pads an archive to 10 KiB)."""
    return make_app({**stack.env, "ARCHIVE_MAX_BYTES": "16k"}).test_client()


# ---- round trips ----------------------------------------------------------------------------
def test_a_folder_goes_up_and_comes_back_the_same(run, tmp_path):
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    make_tree(src)
    run.upload_dir(str(src), "/tmp/up/missing/parents")  # made, parents and all
    assert sh(run, "stat -c '%a %u:%g' /tmp/up/missing/parents/run.sh") == "755 0:0"  # root's, as docker cp
    assert sh(run, "/tmp/up/missing/parents/run.sh") == "ran"
    assert sh(run, "readlink /tmp/up/missing/parents/link") == "nested/deeper/note.txt"
    assert sh(run, "cat /tmp/up/missing/parents/link") == "deep"
    assert sh(run, "stat -c %a /tmp/up/missing/parents/nested/private") == "600"
    assert sh(run, "ls -A /tmp/up/missing/parents/empty | wc -l") == "0"
    assert sh(run, "ls /tmp/up/missing/parents") == "blob.bin\nempty\nlink\nnested\nrun.sh"  # contents, not src/
    run.download_dir("/tmp/up/missing/parents", str(back))
    assert tree(back) == tree(src)


def test_upload_dir_merges_into_what_is_there(run, tmp_path):
    sh(run, "mkdir -p /tmp/merge/sub && echo old > /tmp/merge/old.txt && echo keep > /tmp/merge/sub/keep.txt")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "new.txt").write_text("new\n")
    (tmp_path / "old.txt").write_text("replaced\n")
    run.upload_dir(str(tmp_path), "/tmp/merge")
    assert sh(run, "cat /tmp/merge/old.txt /tmp/merge/sub/keep.txt /tmp/merge/sub/new.txt") == "replaced\nkeep\nnew"


def test_a_file_goes_up_and_comes_back(run, tmp_path):
    local, back = tmp_path / "data.bin", tmp_path / "out" / "copy.bin"
    local.write_bytes(os.urandom(100_000))
    local.chmod(0o640)
    run.upload_file(str(local), "/tmp/files/new/data.bin")
    assert sh(run, "stat -c '%a %s' /tmp/files/new/data.bin") == "640 100000"
    run.download_file("/tmp/files/new/data.bin", str(back))
    assert back.read_bytes() == local.read_bytes()
    assert stat.S_IMODE(back.stat().st_mode) == 0o640


def test_raw_archives_and_the_jobs_they_make(run, stack):
    result = run.put_archive("/tmp/raw", tar_of(("owned.txt", FILE, b"mine"), uid=1234))
    assert result == {"path": "/tmp/raw", "size": result["size"]} and result["size"] > 0
    assert sh(run, "stat -c %u:%g /tmp/raw/owned.txt") == "1234:1234"  # the header's ids are kept
    data = run.get_archive("/tmp/raw")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = {m.name: m for m in tar}
        assert tar.extractfile(names["raw/owned.txt"]).read() == b"mine"
    kinds = [get_job(stack, job_id)["kind"] for job_id in run.info()["jobs"]]
    assert "put_archive" in kinds and "get_archive" in kinds


def get_job(stack, job_id: str) -> dict:
    reply = stack.get(f"/v1/jobs/{job_id}")
    assert reply.status_code == 200, reply.text
    return reply.json()["job"]


def test_async_client(stack, run, tmp_path):
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    make_tree(src)

    async def round_trip():
        async with AsyncPool(stack.url, job_timeout=600) as apool:
            arun = await apool.run(run.id)
            await arun.upload_dir(str(src), "/tmp/async")
            await arun.download_dir("/tmp/async", str(back))
            await arun.upload_file(str(src / "blob.bin"), "/tmp/async-file/b.bin")
            await arun.download_file("/tmp/async-file/b.bin", str(tmp_path / "b.bin"))
            return await arun.get_archive("/tmp/async/run.sh")

    data = asyncio.run(round_trip())
    assert tree(back) == tree(src)
    assert (tmp_path / "b.bin").read_bytes() == (src / "blob.bin").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert [(m.name, stat.S_IMODE(m.mode)) for m in tar] == [("run.sh", 0o755)]


def test_compose_run_uses_the_agents_container(pool, tmp_path):
    src, back = tmp_path / "src", tmp_path / "back"
    src.mkdir()
    make_tree(src)
    with pool.start("two-service-small") as run:
        run.upload_dir(str(src), "/srv/uploaded")
        assert sh(run, "cat /srv/uploaded/nested/deeper/note.txt") == "deep"  # the tools' container
        run.download_dir("/srv/uploaded", str(back))
    assert tree(back) == tree(src)


# ---- failures -------------------------------------------------------------------------------
def test_a_missing_path_fails_with_its_code(run, tmp_path):
    with pytest.raises(PathNotFound) as caught:
        run.download_file("/no/such/file", str(tmp_path / "x"))
    assert caught.value.code == "PATH_NOT_FOUND" and caught.value.retryable is False
    assert caught.value.job["kind"] == "get_archive"
    assert not (tmp_path / "x").exists()


def test_extracting_into_a_file_fails_with_its_code(run):
    sh(run, "mkdir -p /tmp/plain && echo x > /tmp/plain/file")
    with pytest.raises(NotADirectory) as caught:
        run.put_archive("/tmp/plain/file", tar_of(("a", FILE, b"a")))
    assert caught.value.code == "NOT_A_DIRECTORY" and not caught.value.retryable
    with pytest.raises(NotADirectory):
        run.put_archive("/tmp/plain/file/below", tar_of(("a", FILE, b"a")))
    assert sh(run, "cat /tmp/plain/file") == "x"


def test_download_dir_of_a_file_and_download_file_of_a_dir_are_refused(run, tmp_path):
    sh(run, "mkdir -p /tmp/kinds && echo x > /tmp/kinds/f")
    with pytest.raises(NotADirectoryError):
        run.download_dir("/tmp/kinds/f", str(tmp_path / "d"))
    with pytest.raises(IsADirectoryError):
        run.download_file("/tmp/kinds", str(tmp_path / "f"))


BAD_ARCHIVES = {
    "dot-dot": tar_of(("ok", FILE, b"x"), ("../x", FILE, b"x")),
    "absolute": tar_of(("/tmp/bad/abs", FILE, b"x")),
    "hard link out": tar_of(("h", LINK, b"/etc/passwd")),
    "hard link to a name not in it": tar_of(("h", LINK, b"passwd")),
    "through its own symlink": tar_of(("s", SYM, b"/tmp"), ("s/evil", FILE, b"x")),
    "fifo": tar_of(("pipe", tarfile.FIFOTYPE, b"")),
    "garbage": os.urandom(3000),
    "gzip": b"\x1f\x8b\x08\x00" + bytes(100),
    "empty body": b"",
}


@pytest.mark.parametrize("name", sorted(BAD_ARCHIVES))
def test_a_bad_archive_changes_nothing(stack, run, name):
    before, jobs = blobs(stack), len(run.info()["jobs"])
    reply = requests.put(
        f"{stack.url}/v1/runs/{run.id}/archive", params={"path": "/tmp/bad"}, data=BAD_ARCHIVES[name], timeout=30
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["code"] == "BAD_ARCHIVE" and reply.json()["retryable"] is False
    assert blobs(stack) <= before and len(run.info()["jobs"]) == jobs  # no blob, no job
    assert sh(run, "ls /tmp/bad /tmp/x /tmp/evil 2>&1 | grep -c 'No such file'") == "3"


def test_bad_paths_and_runs_are_refused(stack, run, pool):
    good = tar_of(("a", FILE, b"a"))
    for path in ("relative/dir", "", "/tmp/new\nline"):
        reply = requests.put(f"{stack.url}/v1/runs/{run.id}/archive", params={"path": path}, data=good, timeout=30)
        assert (reply.status_code, reply.json()["code"]) == (400, "BAD_REQUEST"), (path, reply.text)
    for path in ("etc", "/" + "x" * 5000, 7):  # a long path in the body: a URL that long is refused by gunicorn
        reply = stack.post(f"/v1/runs/{run.id}/archive/export", {"path": path})
        assert (reply.status_code, reply.json()["code"]) == (400, "BAD_REQUEST"), (path, reply.text)
    missing = "run-0000000000000000"
    with pytest.raises(UnknownRun):
        pool.run(missing)
    reply = requests.put(f"{stack.url}/v1/runs/{missing}/archive", params={"path": "/tmp"}, data=good, timeout=30)
    assert (reply.status_code, reply.json()["code"]) == (404, "UNKNOWN_RUN")


def test_a_closed_run_takes_no_archive(pool, stack):
    run = pool.start("hello-file")
    run.close(wait=True)
    before = blobs(stack)
    with pytest.raises(RunClosed):
        run.put_archive("/tmp", tar_of(("a", FILE, b"a")))
    with pytest.raises(RunClosed):
        run.get_archive("/etc/hostname")
    assert blobs(stack) <= before


def test_reading_an_archive_that_is_not_there(stack, run, pool):
    unknown = "00000000-0000-4000-8000-000000000000"
    reply = stack.get(f"/v1/jobs/{unknown}/archive")
    assert (reply.status_code, reply.json()["code"]) == (404, "UNKNOWN_JOB")
    tool_job = run.submit("shell_exec", id="main", command="true", block=True, timeout=10).id
    reply = stack.get(f"/v1/jobs/{tool_job}/archive")
    assert (reply.status_code, reply.json()["code"]) == (404, "ARCHIVE_NOT_FOUND")
    reply = stack.post(f"/v1/runs/{run.id}/archive/export", {"path": "/etc/hostname"})
    job_id = reply.json()["job_id"]
    assert pool.job(job_id).wait()["path_type"] == "file"
    archive = stack.get(f"/v1/jobs/{job_id}/archive")
    assert archive.status_code == 200 and archive.headers["Content-Type"] == "application/x-tar"
    assert stack.get(f"/v1/jobs/{job_id}/archive").content == archive.content  # read again until it expires
    stack.redis.delete(f"{PREFIX}blob:{job_id}")  # as ARCHIVE_TTL would
    reply = stack.get(f"/v1/jobs/{job_id}/archive")
    assert (reply.status_code, reply.json()["code"]) == (404, "ARCHIVE_NOT_FOUND")


def test_the_size_limit_both_ways(stack, run, pool, small_facade):
    before = blobs(stack)
    big = tar_of(("big", FILE, os.urandom(32768)))
    reply = small_facade.put(f"/v1/runs/{run.id}/archive?path=/tmp/big", data=big)
    assert reply.status_code == 413 and reply.json["code"] == "PAYLOAD_TOO_LARGE", reply.json
    assert "16384" in reply.json["error"]
    assert blobs(stack) <= before
    assert (
        small_facade.put(f"/v1/runs/{run.id}/archive?path=/tmp/small", data=tar_of(("s", FILE, b"s"))).status_code
        == 202
    )
    sh(run, "head -c 100000 /dev/urandom > /tmp/large.bin")
    reply = small_facade.post(f"/v1/runs/{run.id}/archive/export", json={"path": "/tmp/large.bin"})
    assert reply.status_code == 202, reply.json
    job_id = reply.json["job_id"]
    with pytest.raises(TermpoolError) as caught:
        pool.job(job_id).wait()
    assert caught.value.code == "ARCHIVE_TOO_LARGE" and caught.value.retryable is False
    assert stack.redis.exists(f"{PREFIX}blob:{job_id}") == 0
