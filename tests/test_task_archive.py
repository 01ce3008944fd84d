"""Uploaded task archives as pure logic (poolcore/task_archive.py, poolcore/uploaded_tasks.py,
the client's termpool/client/task_tar.py): the canonical digest, every refusal, writing a
folder out, and the task formats an upload may hold. No Docker, no Redis."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import tarfile

import pytest

from app import models
from devstack import FIXTURES, ROOT
from poolcore import uploaded_tasks
from poolcore.config import load_settings
from poolcore.task_archive import ArchiveInvalid, ArchiveTooLarge, Limits, digest, read_archive, write_folder
from termpool.client.task_tar import folder_archive

pytestmark = pytest.mark.unit

LIMITS = Limits(max_bytes=1 << 20, max_files=100)
HARBOR = ROOT / "tests" / "fixtures" / "harbor"


def tar(*members, gz: bool = False) -> bytes:
    """An archive of (name, kind, extra) members: kind file (extra: bytes), dir, symlink or
    hardlink (extra: target), fifo, chr; options as TarInfo attributes in a dict 4th item."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:", format=tarfile.PAX_FORMAT) as out:
        for name, kind, extra, *options in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            for key, value in (options[0] if options else {}).items():
                setattr(info, key, value)
            data = None
            if kind == "file":
                info.size, data = len(extra), io.BytesIO(extra)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, options[0].get("mode", 0o755) if options else 0o755
            elif kind in ("symlink", "hardlink"):
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = extra
            else:
                info.type = {"fifo": tarfile.FIFOTYPE, "chr": tarfile.CHRTYPE}[kind]
            out.addfile(info, data)
    return gzip.compress(raw.getvalue()) if gz else raw.getvalue()


def paths(body: bytes) -> list[str]:
    return [entry.path for entry in read_archive(body, LIMITS)]


def digest_of(body: bytes) -> str:
    return digest(read_archive(body, LIMITS))


# ---- the canonical digest -----------------------------------------------------------------------
def test_digest_ignores_mtimes_owners_order_and_compression():
    first = tar(("a.txt", "file", b"A", {"mtime": 1}), ("d/b.txt", "file", b"B", {"uid": 7, "uname": "x"}))
    second = tar(("./d/b.txt", "file", b"B", {"mtime": 99}), ("./a.txt", "file", b"A", {"gid": 5}), gz=True)
    assert digest_of(first) == digest_of(second)
    assert paths(first) == ["a.txt", "d", "d/b.txt"]  # the implied directory, mode 0755


def test_digest_follows_contents_modes_types_and_targets():
    base = digest_of(tar(("a", "file", b"x"), ("l", "symlink", "a")))
    assert digest_of(tar(("a", "file", b"y"), ("l", "symlink", "a"))) != base
    assert digest_of(tar(("a", "file", b"x", {"mode": 0o755}), ("l", "symlink", "a"))) != base
    assert digest_of(tar(("a", "file", b"x"), ("l", "file", b"a"))) != base
    assert digest_of(tar(("a", "file", b"x"), ("b", "file", b""), ("l", "symlink", "b"))) != base


def test_explicit_directory_of_mode_0755_is_the_implied_one():
    implied = tar(("d/f", "file", b"1"))
    explicit = tar(("d", "dir", None, {"mode": 0o755}), ("d/f", "file", b"1"))
    other_mode = tar(("d", "dir", None, {"mode": 0o700}), ("d/f", "file", b"1"))
    assert digest_of(implied) == digest_of(explicit) != digest_of(other_mode)


def test_client_archive_is_deterministic_and_digests_like_the_folder(tmp_path):
    folder = tmp_path / "task"
    shutil.copytree(HARBOR / "harbor-hello", folder, symlinks=True)
    os.symlink("instruction.md", folder / "prompt.md")
    first = folder_archive(folder)
    os.utime(folder / "task.toml", (1, 1))  # mtimes do not count
    assert folder_archive(folder) == first
    entries = read_archive(first, LIMITS)
    assert {e.path: e.kind for e in entries}["prompt.md"] == "symlink"
    out = tmp_path / "out"
    out.mkdir()
    write_folder(entries, out)
    assert digest(read_archive(folder_archive(out), LIMITS)) == digest(entries)
    assert os.readlink(out / "prompt.md") == "instruction.md"
    assert (out / "tests" / "test.sh").read_bytes() == (folder / "tests" / "test.sh").read_bytes()


# ---- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "members, text",
    [
        ([("/etc/passwd", "file", b"x")], "absolute"),
        ([("a/../../x", "file", b"x")], "'..'"),
        ([("l", "symlink", "/etc")], "relative target"),
        ([("l", "symlink", "../outside")], "leaves the folder"),
        ([("d/l", "symlink", "../../x")], "leaves the folder"),
        # lexically inside, but sub/up is the folder itself, so its .. is outside
        ([("sub/up", "symlink", ".."), ("l", "symlink", "sub/up/..")], "leaves the folder"),
        ([("a", "symlink", "b"), ("b", "symlink", "a")], "loops"),
        ([("f", "file", b"x"), ("h", "hardlink", "f")], "hard links"),
        ([("p", "fifo", None)], "fifos"),
        ([("c", "chr", None)], "device"),
        ([("a", "file", b"1"), ("a", "file", b"2")], "twice"),
        ([("d", "symlink", "sub"), ("sub/x", "file", b""), ("d/y", "file", b"")], "is a symlink"),
        ([("f", "file", b""), ("f/g", "file", b"")], "is a file"),
    ],
)
def test_unsafe_archives_are_refused(members, text):
    with pytest.raises(ArchiveInvalid) as caught:
        read_archive(tar(*members), LIMITS)
    assert text in str(caught.value)
    assert not isinstance(caught.value, ArchiveTooLarge)


def test_unreadable_archives_are_refused():
    for body in (b"", b"not a tar at all" * 100, gzip.compress(b"x" * 1000)[:40]):
        with pytest.raises(ArchiveInvalid):
            read_archive(body, LIMITS)


def test_a_name_that_is_not_utf8_is_refused():
    raw = bytearray(tar(("ab.txt", "file", b"x")))
    raw[raw.index(b"ab.txt") + 1] = 0xFF  # in the PAX path record and the plain header alike
    with pytest.raises(ArchiveInvalid, match="UTF-8|readable"):
        read_archive(bytes(raw), LIMITS)


def test_limits_of_size_and_members():
    with pytest.raises(ArchiveTooLarge, match="UPLOADED_TASK_MAX_BYTES"):
        read_archive(tar(("a", "file", b"x" * 600_000), ("b", "file", b"y" * 600_000)), LIMITS)
    with pytest.raises(ArchiveTooLarge, match="UPLOADED_TASK_MAX_FILES"):
        read_archive(tar(*[(f"f{i}", "file", b"") for i in range(101)]), LIMITS)
    deep = "/".join(["d"] * 60)  # 101 entries once the folders it implies count
    with pytest.raises(ArchiveTooLarge, match="folders counted"):
        read_archive(tar(*[(f"{deep}/{i}/f", "file", b"") for i in range(41)]), LIMITS)
    # a gzip bomb: a few KB that would unpack to 64 MB stops at the limit
    bomb = gzip.compress(b"\0" * (64 << 20))
    assert len(bomb) < 100_000
    with pytest.raises(ArchiveTooLarge):
        read_archive(bomb, LIMITS)
    assert len(paths(tar(("a", "file", b"x" * 1_000_000)))) == 1  # at the limit: taken


# ---- task formats -------------------------------------------------------------------------------
def test_each_format_is_accepted_with_its_kind(tmp_path):
    bare = tmp_path / "bare"
    (bare / "environment").mkdir(parents=True)
    (bare / "environment" / "Dockerfile").write_text("FROM termpool-test-base:bookworm\n")
    (bare / "task.toml").write_text("[environment]\ncpus = 1\nmemory_mb = 512\n")
    for folder, kind in (
        (FIXTURES / "hello-file", "terminal-bench"),
        (HARBOR / "harbor-hello", "harbor"),
        (bare, "harbor-environment"),
    ):
        upload = uploaded_tasks.accept(folder_archive(folder), LIMITS)
        assert upload.kind == kind
        assert upload.task_path == "sha256:" + digest(read_archive(upload.archive, LIMITS))
        assert upload.task_path == uploaded_tasks.accept(upload.archive, LIMITS).task_path  # stored form: same


def test_an_upload_says_why_it_allows_one_live_run_per_host():
    pinned = uploaded_tasks.accept(folder_archive(FIXTURES / "compose-fixed-subnet"), LIMITS)
    assert pinned.one_per_host and "fixed subnet" in pinned.one_per_host[0]
    assert uploaded_tasks.accept(folder_archive(FIXTURES / "hello-file"), LIMITS).one_per_host == ()


@pytest.mark.parametrize(
    "files, text",
    [
        ({"readme.md": "hi"}, "not a task: no task.yaml"),
        ({"task.toml": "[environment]\n"}, "instruction.md (a Harbor task) or an environment/"),
        ({"task.yaml": "instruction: x\n", "run-tests.sh": ""}, "needs a Dockerfile or a docker-compose.yaml"),
        ({"task.yaml": "instruction: x\n", "Dockerfile": "FROM x\n"}, "no run-tests.sh"),
        ({"task.yaml": "instruction: [\n", "Dockerfile": "FROM x\n"}, "invalid YAML"),
        ({"task.toml": "", "instruction.md": "do it", "tests/test.sh": ""}, "needs an environment/ folder"),
        ({"task.toml": "[environment]\ngpus = 1\n", "environment/Dockerfile": "FROM x\n"}, "termpool has no GPUs"),
        ({"task.toml": "[environment\n", "environment/Dockerfile": "FROM x\n"}, "invalid TOML"),
    ],
)
def test_folders_that_are_not_tasks_are_refused(tmp_path, files, text):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    with pytest.raises(ArchiveInvalid) as caught:
        uploaded_tasks.accept(folder_archive(tmp_path), LIMITS)
    assert text in str(caught.value)
    assert str(tmp_path) not in str(caught.value)  # no server path in the answer


# ---- names and the worker's side ----------------------------------------------------------------
def test_task_paths_and_the_names_derived_from_them():
    path = "sha256:" + "ab" * 32
    assert uploaded_tasks.blob_id(path) == "task:" + "ab" * 32
    name = uploaded_tasks.folder_name(path)
    assert uploaded_tasks.docker_task_name({"task_name": "hello", "task_path": path}) == name
    assert uploaded_tasks.docker_task_name({"task_name": "hello", "task_path": "hello"}) == "hello"
    from poolcore.task_spec import image_name, valid_task_name

    assert valid_task_name(name) and image_name(name) == f"tb__{name}__client"
    for bad in ("sha256:" + "AB" * 32, "sha256:abc", "sha256:" + "ab" * 32 + "/x"):
        with pytest.raises(ValueError):
            uploaded_tasks.checked_task_path(bad)


def test_task_meta_takes_a_digest_without_the_dataset_and_refuses_a_malformed_one(tmp_path):
    cfg = load_settings({"DATASET_DIR": str(FIXTURES), "TBENCH_OUTPUT_ROOT": str(tmp_path)})
    path = "sha256:" + "0f" * 32
    meta = models.TaskMeta.model_validate({"task_name": "x", "task_path": path}, context={"cfg": cfg})
    assert meta.task_path == path
    with pytest.raises(Exception, match="64 lowercase hex"):
        models.TaskMeta.model_validate({"task_name": "x", "task_path": "sha256:nope"}, context={"cfg": cfg})


def test_materialize_checks_the_digest_and_writes_atomically(tmp_path):
    body = folder_archive(FIXTURES / "hello-file")
    upload = uploaded_tasks.accept(body, LIMITS)
    folder = tmp_path / "cache" / uploaded_tasks.folder_name(upload.task_path)
    with pytest.raises(ArchiveInvalid, match="does not match"):
        uploaded_tasks.materialize(upload.archive, folder, LIMITS, "sha256:" + "0" * 64)
    assert not folder.exists()


def test_materialize_leaves_nothing_when_writing_fails(tmp_path, monkeypatch):
    upload = uploaded_tasks.accept(folder_archive(FIXTURES / "hello-file"), LIMITS)
    folder = tmp_path / uploaded_tasks.folder_name(upload.task_path)

    def half_written(entries, into):
        (into / "task.yaml").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(uploaded_tasks.task_archive, "write_folder", half_written)
    with pytest.raises(OSError, match="disk full"):
        uploaded_tasks.materialize(upload.archive, folder, LIMITS, upload.task_path)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temp folder


def test_materialize_writes_the_folder_once(tmp_path):
    upload = uploaded_tasks.accept(folder_archive(FIXTURES / "hello-file"), LIMITS)
    folder = tmp_path / "cache" / uploaded_tasks.folder_name(upload.task_path)
    assert uploaded_tasks.materialize(upload.archive, folder, LIMITS, upload.task_path) == folder
    assert (folder / "task.yaml").read_bytes() == (FIXTURES / "hello-file" / "task.yaml").read_bytes()
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # the temp folder is gone
    assert uploaded_tasks.materialize(b"ignored: present", folder, LIMITS, upload.task_path) == folder


def test_written_folder_matches_the_archive(tmp_path):
    body = tar(
        ("ro", "dir", None, {"mode": 0o555}), ("ro/f", "file", b"data", {"mode": 0o640}), ("l", "symlink", "ro/f")
    )
    write_folder(read_archive(body, LIMITS), tmp_path)
    assert (tmp_path / "l").read_bytes() == b"data"
    assert (tmp_path / "ro" / "f").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "ro").stat().st_mode & 0o777 == 0o555
    (tmp_path / "ro").chmod(0o755)  # so tmp_path can be removed


def test_the_reconcile_removes_only_expired_folders_no_live_run_names(tmp_path, monkeypatch):
    from tasks import task_folders

    stored, expired, live = ("sha256:" + c * 64 for c in "abc")
    for path in (stored, expired, live):
        (tmp_path / uploaded_tasks.folder_name(path)).mkdir()
    (tmp_path / ".sha256-half-written").mkdir()  # another worker's temp folder: not touched

    class Blobs:
        def blob_size(self, blob_id):
            return 10 if blob_id == uploaded_tasks.blob_id(stored) else None

    monkeypatch.setattr(task_folders, "store", Blobs)
    monkeypatch.setattr(task_folders, "settings", lambda: load_settings({"UPLOADED_TASKS_DIR": str(tmp_path)}))
    assert task_folders.remove_expired({live}) == [uploaded_tasks.folder_name(expired)]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        [".sha256-half-written", uploaded_tasks.folder_name(stored), uploaded_tasks.folder_name(live)]
    )


def test_a_bare_environment_loads_without_instruction_or_tests(tmp_path):
    from poolcore.task_spec import compose_file, load_task, load_task_cached

    folder = tmp_path / "env"
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text("FROM x\n")
    (folder / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    (folder / "task.toml").write_text('[environment]\ncpus = 2\nmemory = "1G"\n')
    spec = load_task(folder)
    assert (spec.instruction, spec.has_tests, spec.harbor.cpus, spec.harbor.memory_mb) == ("", False, 2.0, 1024)
    assert load_task_cached(folder) is load_task_cached(folder)  # cached though it has no tests/test.sh
    assert compose_file(folder) == folder / "environment" / "docker-compose.yaml"
    assert load_task(HARBOR / "harbor-hello").has_tests
