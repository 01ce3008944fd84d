"""What a tar archive may hold on its way into a run or out of one.

One set of rules for both ends: the facade checks an upload before anything is stored or
queued (app/archives_api.py), and the client checks a download before it writes a file
(termpool/client/archives.py). Standard library only, so the client can use it.

An archive is a plain (uncompressed) tar whose members are regular files, directories,
symlinks and hard links, named relative to the folder it lands in:
  * no absolute name and no name that leaves the folder through `..`;
  * no member under a symlink of the same archive (`a -> /etc`, then `a/passwd`): a name
    must not lead out of the folder through a link the archive itself made;
  * a hard link names an earlier member of the archive, never a file already on the target;
  * no device nodes or fifos: a file transfer has no business making a device (the daemon
    extracts as root, with only the container's device rules between the node and the
    host's hardware), and a fifo blocks whatever reads it (a test, `cat`); no task needs one;
  * no sparse members: their extracted size is not bounded by the archive's;
  * nothing after the end of the archive but zero padding (the Engine's tar reader would
    refuse it after the upload was accepted).
A symlink's target is kept as it is, absolute or not: it is a link, and nothing is written
through it.
"""

from __future__ import annotations

import io
import posixpath
import tarfile

ALLOWED_TYPES = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE}
REFUSED_KINDS = {tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a fifo"}


class ArchiveRefused(ValueError):
    """The archive breaks one of the rules above; the message says which member and why."""


def relative_name(name: str) -> str:
    """A member's name normalized ("./a//b/" -> "a/b", the folder itself "."); ArchiveRefused
    for an absolute name or one that leaves the folder."""
    if name.startswith("/"):
        raise ArchiveRefused(f"member {name!r} has an absolute name")
    normal = posixpath.normpath(name) if name else "."
    if normal == ".." or normal.startswith("../"):
        raise ArchiveRefused(f"member {name!r} leaves the target folder through '..'")
    return normal


def _parents(name: str):
    """Every proper parent of a normalized relative name ("a/b/c" -> "a", "a/b")."""
    parts = name.split("/")
    return ("/".join(parts[:i]) for i in range(1, len(parts)))


class _Members:
    """The names seen so far while reading an archive, to judge the next member by."""

    def __init__(self):
        self.files: set[str] = set()  # regular files and hard links: what a hard link may name
        self.symlinks: set[str] = set()

    def check(self, member: tarfile.TarInfo) -> str:
        if member.type in REFUSED_KINDS:
            raise ArchiveRefused(f"member {member.name!r} is {REFUSED_KINDS[member.type]}: refused")
        if member.type not in ALLOWED_TYPES or member.issparse():
            raise ArchiveRefused(f"member {member.name!r} is not a file, directory or link (tar type {member.type!r})")
        name = relative_name(member.name)
        if name == "." and not member.isdir():
            raise ArchiveRefused(f"member {member.name!r} names the target folder itself but is not a directory")
        through = next((parent for parent in _parents(name) if parent in self.symlinks), None)
        if through is not None:
            raise ArchiveRefused(f"member {member.name!r} lies under {through!r}, a symlink of the same archive")
        if member.islnk():
            target = relative_name(member.linkname)
            if target not in self.files:
                raise ArchiveRefused(f"hard link {member.name!r} points to {member.linkname!r}, not an earlier file")
        (self.files.add if member.isreg() or member.islnk() else self.files.discard)(name)
        (self.symlinks.add if member.issym() else self.symlinks.discard)(name)
        return name


def check_archive(data: bytes, skip_special: bool = False) -> list[tarfile.TarInfo]:
    """The members of a plain tar that keeps every rule (module doc), in archive order;
    ArchiveRefused for anything else: not a tar, compressed, truncated, or a member refused.
    skip_special: leave device nodes and fifos out instead (a download of a folder that holds
    one: the rest is still wanted)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members, seen = [], _Members()
            for member in tar:
                if skip_special and member.type in REFUSED_KINDS:
                    continue
                seen.check(member)
                if member.offset_data + (member.size if member.isreg() else 0) > len(data):
                    raise ArchiveRefused(f"the archive is truncated: member {member.name!r} is cut short")
                members.append(member)
            end = tar.offset
    except (tarfile.TarError, EOFError) as exc:
        raise ArchiveRefused(f"not a readable uncompressed tar archive: {exc}") from None
    if memoryview(data)[end:].tobytes().strip(b"\0"):
        raise ArchiveRefused(f"bytes that are not a tar header follow the last member (at byte {end})")
    return members
