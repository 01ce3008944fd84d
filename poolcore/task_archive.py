"""A task folder sent as a tar archive (plain or gzip): read safely, put in canonical form,
digested, and written out as a folder (docs/task-format.md, "Uploaded tasks"). Pure logic and
the standard library: the facade reads an upload with it, a worker host the stored copy.

The digest covers what makes the folder, never how it was packed: each entry's path (sorted),
type, permission bits, symlink target and contents; not mtimes, owners or the order of the
archive. A directory the archive implies without an entry of its own counts as mode 0755.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

DIGEST_VERSION = b"termpool task folder v1\0"
MAX_LINK_HOPS = 40  # as the kernel's ELOOP limit
MAX_NAME_BYTES = 255  # one path component
MAX_PATH_BYTES = 4096
IMPLIED_DIR_MODE = 0o755
HEADER_ALLOWANCE = 3 * 512  # a member's header, a PAX header and padding, in the raw tar


class ArchiveInvalid(ValueError):
    """Not a safe, readable tar of a folder (TASK_ARCHIVE_INVALID)."""


class ArchiveTooLarge(ArchiveInvalid):
    """More bytes or members than the limits allow (TASK_ARCHIVE_TOO_LARGE)."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # the files' contents, unpacked, all together
    max_files: int  # entries of any type

    @property
    def raw_bytes(self) -> int:
        """The most an uncompressed tar within these limits can take (also the body limit)."""
        return self.max_bytes + (self.max_files + 4) * HEADER_ALLOWANCE + 20 * 512


@dataclass(frozen=True)
class Entry:
    path: str  # relative, "/"-separated, no "." or ".." parts
    kind: str  # "dir", "file" or "symlink"
    mode: int  # permission bits
    data: bytes = b""
    target: str = ""


# ---- reading ------------------------------------------------------------------------------------
def read_archive(body: bytes, limits: Limits) -> list[Entry]:
    """The folder's entries, sorted by path, implied directories added; ArchiveInvalid (or
    ArchiveTooLarge) says what is wrong."""
    raw = _unpacked(body, limits.raw_bytes)
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            entries = _entries(tar, limits)
    except tarfile.TarError as exc:
        raise ArchiveInvalid(f"not a readable tar archive: {exc}") from None
    entries = _with_parents(entries, limits)
    for entry in entries.values():
        if entry.kind == "symlink" and not _stays_inside(entries, entry.path):
            raise ArchiveInvalid(f"{entry.path}: symlink to {entry.target!r} leaves the folder (or loops)")
    return [entries[path] for path in sorted(entries, key=lambda p: p.encode())]


def _unpacked(body: bytes, limit: int) -> bytes:
    """The tar itself: gzip undone (every member of a multi-member file), never past `limit`."""
    if body[:2] != b"\x1f\x8b":
        if len(body) > limit:
            raise ArchiveTooLarge(f"the archive is larger than {limit} bytes")
        return body
    out, rest = bytearray(), body
    try:
        while rest.strip(b"\0"):  # some tools pad a gzip file with zeros
            inflater = zlib.decompressobj(wbits=31)
            out += inflater.decompress(rest, limit + 1 - len(out))
            if len(out) > limit or inflater.unconsumed_tail:
                raise ArchiveTooLarge(f"the archive unpacks to more than {limit} bytes of tar")
            if not inflater.eof:
                raise ArchiveInvalid("the gzip stream is cut short")
            rest = inflater.unused_data
    except zlib.error as exc:
        raise ArchiveInvalid(f"not a readable gzip stream: {exc}") from None
    return bytes(out)


def _entries(tar: tarfile.TarFile, limits: Limits) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    total = 0
    for count, member in enumerate(tar, 1):
        if count > limits.max_files:
            raise ArchiveTooLarge(f"the archive holds more than {limits.max_files} entries (UPLOADED_TASK_MAX_FILES)")
        path = _clean_path(member.name)
        if path is None:
            if not member.isdir():
                raise ArchiveInvalid(f"{member.name!r}: only a directory may name the folder itself")
            continue
        if path in entries:
            raise ArchiveInvalid(f"{path}: appears twice in the archive")
        if member.isfile():
            total += member.size
            if total > limits.max_bytes:
                raise ArchiveTooLarge(
                    f"the files unpack to more than {limits.max_bytes} bytes (UPLOADED_TASK_MAX_BYTES)"
                )
        entries[path] = _entry(tar, member, path)
    return entries


def _entry(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> Entry:
    mode = member.mode & 0o777
    if member.isdir():
        return Entry(path, "dir", mode)
    if member.isfile():
        return Entry(path, "file", mode, data=tar.extractfile(member).read())
    if member.issym():
        target = member.linkname
        if not target or target.startswith("/") or "\0" in target or not _utf8(target):
            raise ArchiveInvalid(f"{path}: symlink to {target!r}: only a relative target inside the folder is taken")
        return Entry(path, "symlink", mode, target=target)
    if member.islnk():
        raise ArchiveInvalid(f"{path}: hard links are not taken (send the file itself)")
    if member.ischr() or member.isblk() or member.isfifo():
        raise ArchiveInvalid(f"{path}: device nodes and fifos are not taken")
    raise ArchiveInvalid(f"{path}: an entry of tar type {member.type!r} is not taken")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")  # tarfile keeps undecodable bytes as surrogates
    except UnicodeEncodeError:
        return False
    return True


def _clean_path(name: str) -> str | None:
    """The member's path relative to the folder; None for the folder itself ("." or "./")."""
    if not _utf8(name):
        raise ArchiveInvalid(f"{name!r}: the name is not UTF-8")
    if name.startswith("/"):
        raise ArchiveInvalid(f"{name!r}: absolute names are not taken")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ArchiveInvalid(f"{name!r}: '..' would leave the folder")
    if any(len(part.encode()) > MAX_NAME_BYTES for part in parts) or len(name.encode()) > MAX_PATH_BYTES:
        raise ArchiveInvalid(f"{name[:100]!r}...: a name longer than the file system takes")
    return "/".join(parts) or None


def _with_parents(entries: dict[str, Entry], limits: Limits) -> dict[str, Entry]:
    """Add the directories the paths imply (counted as entries: deep paths cannot make millions
    of them); ArchiveInvalid when a path passes through a file or a symlink (writing it would
    write through the link)."""
    full = dict(entries)
    for path in entries:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            known = full.setdefault(parent, Entry(parent, "dir", IMPLIED_DIR_MODE))
            if known.kind != "dir":
                raise ArchiveInvalid(f"{path}: its parent {parent} is a {known.kind}, not a directory")
        if len(full) > limits.max_files:
            raise ArchiveTooLarge(
                f"the archive makes more than {limits.max_files} entries, its folders counted (UPLOADED_TASK_MAX_FILES)"
            )
    return full


def _stays_inside(entries: dict[str, Entry], path: str) -> bool:
    """Whether resolving `path` (a symlink) as the kernel would, following the links the
    archive holds, stays inside the folder; a name the archive lacks is taken as written."""
    pending, current, hops = path.split("/"), [], 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not current:
                return False
            current.pop()
            continue
        current.append(part)
        entry = entries.get("/".join(current))
        if entry is not None and entry.kind == "symlink":
            hops += 1
            if hops > MAX_LINK_HOPS or entry.target.startswith("/"):
                return False
            current.pop()
            pending = entry.target.split("/") + pending
    return True


# ---- canonical form -----------------------------------------------------------------------------
def digest(entries: list[Entry]) -> str:
    """SHA-256 (hex) of the folder's canonical form: entries sorted by path, each its type,
    permission bits, path, symlink target, size and the SHA-256 of its contents."""
    total = hashlib.sha256(DIGEST_VERSION)
    for entry in sorted(entries, key=lambda e: e.path.encode()):
        fields = (entry.kind, f"{entry.mode:o}", entry.path, entry.target, str(len(entry.data)))
        total.update("\0".join(fields).encode() + b"\0" + hashlib.sha256(entry.data).digest() + b"\n")
    return total.hexdigest()


def canonical_archive(entries: list[Entry]) -> bytes:
    """The folder as a gzip'd tar with no mtimes or owners, in path order: what is stored."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(entries, key=lambda e: e.path.encode()):
            info = tarfile.TarInfo(entry.path)
            info.mode, info.mtime = entry.mode, 0
            if entry.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif entry.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, entry.target
            info.size = len(entry.data)
            tar.addfile(info, io.BytesIO(entry.data) if entry.kind == "file" else None)
    return gzip.compress(raw.getvalue(), mtime=0)


def unpacked_size(entries: list[Entry]) -> int:
    return sum(len(entry.data) for entry in entries)


# ---- writing ------------------------------------------------------------------------------------
def write_folder(entries: list[Entry], folder: Path) -> None:
    """Write the entries into `folder` (empty, made by the caller). Nothing follows a link:
    read_archive let no path pass through one, files are made with O_EXCL | O_NOFOLLOW, and
    symlinks come last. Directory modes are set at the end, so a read-only one is filled first."""
    ordered = sorted(entries, key=lambda e: e.path.encode())
    for entry in ordered:
        target = folder / entry.path
        if entry.kind == "dir":
            target.mkdir(mode=0o700)
        elif entry.kind == "file":
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(entry.data)
            os.chmod(target, entry.mode)
    for entry in ordered:
        if entry.kind == "symlink":
            os.symlink(entry.target, folder / entry.path)
    for entry in reversed(ordered):
        if entry.kind == "dir":
            os.chmod(folder / entry.path, entry.mode)
