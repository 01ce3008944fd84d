"""What an archive may hold (termpool/tar_rules.py), and the client's local packing and safe
unpacking (termpool/client/tarballs.py): pure logic, no stack."""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

from termpool.client import BadArchive, tarballs
from termpool.tar_rules import ArchiveRefused, check_archive, relative_name

pytestmark = pytest.mark.unit


def tar_of(*members: tuple[str, bytes | str | None, bytes]) -> bytes:
    """A tar of (name, tar type, data) members; data is a file's content or a link's target."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = data.decode()
                tar.addfile(info)
            elif kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


FILE, DIR, SYM, LINK = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


# ---- the rules --------------------------------------------------------------------------------
def test_a_plain_tree_passes():
    data = tar_of(
        ("./", DIR, b""),
        ("a", DIR, b""),
        ("a/b.bin", FILE, bytes(range(256))),
        ("a/link", SYM, b"/etc/passwd"),  # a symlink may point anywhere: nothing is written through it
        ("a/hard", LINK, b"a/b.bin"),
        ("empty", DIR, b""),
    )
    assert [m.name for m in check_archive(data)] == [".", "a", "a/b.bin", "a/link", "a/hard", "empty"]


def test_an_empty_archive_passes():
    assert check_archive(tar_of()) == []


@pytest.mark.parametrize(
    "members, why",
    [
        ([("../x", FILE, b"x")], "'..'"),
        ([("a/../../x", FILE, b"x")], "'..'"),
        ([("/etc/x", FILE, b"x")], "absolute"),
        ([("x", FILE, b"x"), ("h", LINK, b"/etc/shadow")], "absolute"),
        ([("h", LINK, b"../outside")], "'..'"),
        ([("h", LINK, b"not-there")], "not an earlier file"),
        ([("d", DIR, b""), ("h", LINK, b"d")], "not an earlier file"),
        ([("s", SYM, b"/etc"), ("s/passwd", FILE, b"x")], "symlink of the same archive"),
        ([("s", SYM, b"."), ("s/a/b", FILE, b"x")], "symlink of the same archive"),
        ([("dev", tarfile.CHRTYPE, b"")], "character device"),
        ([("dev", tarfile.BLKTYPE, b"")], "block device"),
        ([("pipe", tarfile.FIFOTYPE, b"")], "fifo"),
        ([(".", FILE, b"x")], "not a directory"),
    ],
)
def test_refused_members(members, why):
    with pytest.raises(ArchiveRefused, match=why):
        check_archive(tar_of(*members))


def test_garbage_and_compressed_bytes_are_refused():
    for data in (b"", b"not a tar at all" * 100, os.urandom(4096)):
        with pytest.raises(ArchiveRefused, match="not a readable"):
            check_archive(data)
    gz = io.BytesIO()
    with tarfile.open(fileobj=gz, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("x"))
    with pytest.raises(ArchiveRefused, match="not a readable"):
        check_archive(gz.getvalue())


def test_a_truncated_archive_is_refused():
    data = tar_of(("big", FILE, b"y" * 5000))
    with pytest.raises(ArchiveRefused):
        check_archive(data[:2048])  # the header and part of the data


def test_bytes_after_the_archive_must_be_zeros():
    data = tar_of(("a", FILE, b"x"))
    check_archive(data + bytes(4096))
    with pytest.raises(ArchiveRefused, match="follow the last member"):
        check_archive(data[:1024] + b"trailing garbage" + bytes(1024))


def test_relative_name_normalizes():
    assert relative_name("./a//b/") == "a/b"
    assert relative_name("") == relative_name("./") == "."
    with pytest.raises(ArchiveRefused):
        relative_name("a/../../b")


# ---- the client's packing and unpacking ----------------------------------------------------------
def make_tree(root):
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "nested" / "deeper" / "note.txt").write_text("deep")
    (root / "link").symlink_to("nested/deeper/note.txt")


def test_pack_then_unpack_keeps_the_tree(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    make_tree(src)
    data = tarballs.pack_dir(src)
    assert all(m.uid == 0 and m.gid == 0 for m in check_archive(data))  # owned by root, as docker cp does
    tarballs.unpack(data, dst)
    assert (dst / "blob.bin").read_bytes() == bytes(range(256)) * 4
    assert stat.S_IMODE((dst / "run.sh").stat().st_mode) == 0o755
    assert os.readlink(dst / "link") == "nested/deeper/note.txt"
    assert (dst / "link").read_text() == "deep"
    assert (dst / "empty").is_dir() and not any((dst / "empty").iterdir())


def test_unpack_merges_and_can_strip_the_top_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("was here")
    data = tar_of(("top", DIR, b""), ("top/new.txt", FILE, b"new"))
    tarballs.unpack(data, tmp_path, lambda name: name.partition("/")[2] or None)
    assert (tmp_path / "keep.txt").read_text() == "was here"
    assert (tmp_path / "new.txt").read_text() == "new" and not (tmp_path / "top").exists()


def test_unpack_never_writes_through_a_link_already_there(tmp_path):
    outside, dest = tmp_path / "outside", tmp_path / "dest"
    outside.mkdir()
    dest.mkdir()
    (dest / "away").symlink_to(outside)
    with pytest.raises(BadArchive, match="outside"):
        tarballs.unpack(tar_of(("away/x", FILE, b"x")), dest)
    (outside / "target.txt").write_text("keep")
    (dest / "file").symlink_to(outside / "target.txt")
    tarballs.unpack(tar_of(("file", FILE, b"replaced")), dest)
    assert (outside / "target.txt").read_text() == "keep"  # the link was replaced, not followed
    assert (dest / "file").read_text() == "replaced" and not (dest / "file").is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["target.txt"]


def test_unpack_refuses_a_bad_archive_before_writing(tmp_path):
    with pytest.raises(BadArchive):
        tarballs.unpack(tar_of(("ok", FILE, b"x"), ("../evil", FILE, b"x")), tmp_path / "d")
    assert not (tmp_path / "d").exists() and not (tmp_path / "evil").exists()


def test_unpack_leaves_devices_and_fifos_out(tmp_path):
    data = tar_of(("pipe", tarfile.FIFOTYPE, b""), ("dev", tarfile.CHRTYPE, b""), ("kept", FILE, b"k"))
    tarballs.unpack(data, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_pack_file_refuses_a_folder_and_a_missing_file(tmp_path):
    with pytest.raises(IsADirectoryError):
        tarballs.pack_file(tmp_path, "x")
    with pytest.raises(FileNotFoundError):
        tarballs.pack_file(tmp_path / "missing", "x")
