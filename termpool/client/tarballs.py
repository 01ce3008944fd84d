"""Local files to tar archives and back, with the standard library, for the archive operations
(archives.py).

Packing keeps modes and symlinks (a link is stored as a link, never followed) and writes root's
ids as the owner, as `docker cp` does: what lands in the container is owned by root there.
Unpacking checks the archive with the rules the server applies to uploads
(termpool/tar_rules.py), except that device nodes and fifos are left out instead of refused,
and writes nothing outside the destination folder: no member name
leaves it, none goes through a symlink (of the archive, or one already in the folder), and a
file replaces a link in its place instead of writing through it. Permission bits are kept
(setuid, setgid and sticky are dropped); files get the user's own ids, as with `docker cp`.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from termpool.client.errors import BadArchive
from termpool.tar_rules import ArchiveRefused, check_archive, relative_name

PERMISSIONS = 0o777


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def pack(entries: list[tuple[Path, str]]) -> bytes:
    """A tar of local paths under the names given (directories with everything below them)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, name in entries:
            tar.add(path, arcname=name, filter=_as_root)
    return buf.getvalue()


def pack_dir(local_dir: str | os.PathLike) -> bytes:
    """The contents of a local folder (not the folder itself), names relative to it."""
    root = Path(local_dir)
    if not root.is_dir():
        raise NotADirectoryError(f"not a directory: {root}")
    return pack([(child, child.name) for child in sorted(root.iterdir())])


def pack_file(local: str | os.PathLike, name: str) -> bytes:
    """One local file (or symlink) as the archive's only member `name`."""
    path = Path(local)
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(f"is a directory: {path}")
    if not path.is_symlink() and not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    return pack([(path, name)])


def _target(root: Path, name: str, follow: bool) -> Path:
    """Where a member lands, refused when it (follow) or its folder resolves outside `root`."""
    target = root / name
    resolved = os.path.realpath(target if follow else target.parent)
    if os.path.commonpath([resolved, str(root)]) != str(root):
        raise BadArchive(f"member {name!r} would land outside {root} (through a symlink)")
    return target


def _clear(target: Path) -> None:
    """Make room for a file or link: replace a file or link there, never a folder."""
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        raise IsADirectoryError(f"cannot replace the directory {target} with a file")


def _link_source(root: Path, names: dict, member: tarfile.TarInfo) -> Path:
    source = names[relative_name(member.linkname)]
    if source is None:
        raise BadArchive(f"hard link {member.name!r} points to {member.linkname!r}, which is not extracted")
    return root / source


def unpack(data: bytes, dest: str | os.PathLike, rename: Callable[[str], str | None] = lambda name: name) -> None:
    """Write an archive's members into `dest` (made if missing). `rename` maps each member's
    normalized name to where it goes below dest ("." for dest itself), or None to skip it."""
    try:
        members = check_archive(data, skip_special=True)
    except ArchiveRefused as exc:
        raise BadArchive(str(exc)) from None
    root = Path(os.path.realpath(dest))
    root.mkdir(parents=True, exist_ok=True)
    names = {relative_name(m.name): rename(relative_name(m.name)) for m in members}
    folders = []
    for member in members:
        name = names[relative_name(member.name)]
        if name is None:
            continue
        target = _target(root, name, follow=member.isdir())
        target.parent.mkdir(parents=True, exist_ok=True)
        if member.isdir():
            target.mkdir(exist_ok=True)
            folders.append((target, member.mode & PERMISSIONS))
            continue
        _clear(target)
        if member.issym():
            os.symlink(member.linkname, target)
        elif member.islnk():
            os.link(_link_source(root, names, member), target)
        else:
            target.write_bytes(memoryview(data)[member.offset_data : member.offset_data + member.size])
            os.chmod(target, member.mode & PERMISSIONS)
            os.utime(target, (member.mtime, member.mtime))
    for folder, mode in reversed(folders):  # after their contents: a read-only folder was written into
        os.chmod(folder, mode)
