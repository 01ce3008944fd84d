"""A task folder as the deterministic tar.gz that Pool.upload_task sends (stdlib only): its
entries in path order, no mtimes or owners, symlinks kept as links, nothing followed."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

TAR_GZ = "application/gzip"


def folder_archive(folder: str | os.PathLike) -> bytes:
    """The folder's contents at the archive's top level; ValueError for what a task folder
    cannot hold (a socket, a fifo, a device)."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(root):
            _add(tar, path, path.relative_to(root).as_posix())
    return gzip.compress(raw.getvalue(), mtime=0)


def _walk(root: Path) -> list[Path]:
    """Every entry below root, sorted; symlinks to folders are entries, not descended into."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        found += [base / name for name in dirnames + filenames]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix().encode())


def _add(tar: tarfile.TarFile, path: Path, name: str) -> None:
    info = os.lstat(path)
    entry = tarfile.TarInfo(name)
    entry.mode, entry.mtime = stat.S_IMODE(info.st_mode) & 0o777, 0
    if stat.S_ISLNK(info.st_mode):
        entry.type, entry.linkname = tarfile.SYMTYPE, os.readlink(path)
        tar.addfile(entry)
    elif stat.S_ISDIR(info.st_mode):
        entry.type = tarfile.DIRTYPE
        tar.addfile(entry)
    elif stat.S_ISREG(info.st_mode):
        entry.size = info.st_size
        with open(path, "rb") as data:
            tar.addfile(entry, data)
    else:
        raise ValueError(f"{path}: a task folder holds files, folders and symlinks only")
