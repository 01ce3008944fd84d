"""Tar archives into and out of a container through the Engine's archive API (what `docker cp`
uses): put_archive to extract, get_archive to read, and its HEAD request to stat a path.

Extraction merges into the target directory: what is there stays unless the archive holds the
same name. Modes, symlinks and hard links are kept as the archive has them, and so is
ownership: the Engine chowns each member to the uid/gid of its tar header (it extracts as
root). `docker cp` (without -a) writes root's ids into the headers it sends; termpool's client
does the same (termpool/client/archives.py), so its uploads end up owned by root, as with
`docker cp`. A caller of the HTTP API that wants other owners writes their numeric ids.
"""

from __future__ import annotations

import base64
import io
import json
import posixpath
import tarfile
import time
from urllib.parse import quote

import docker.errors

from termpool.failures import DockerError, Failure

DIR_BIT = 1 << 31  # Go's os.ModeDir, in the path stat the Engine answers with
LINK_BIT = 1 << 27  # Go's os.ModeSymlink
STAT_HEADER = "X-Docker-Container-Path-Stat"
CHUNK = 1 << 20  # bytes read from get_archive's stream at a time
NEW_DIR_MODE = 0o755  # of the target's missing parents, made as root (as `mkdir -p` by root would)


class PathNotFound(Failure):
    code = "PATH_NOT_FOUND"


class NotADirectory(Failure):
    code = "NOT_A_DIRECTORY"


class ArchiveTooLarge(Failure):
    code = "ARCHIVE_TOO_LARGE"


def path_stat(container, path: str) -> dict | None:
    """The Engine's stat of a path in the container ({name, size, mode, mtime, linkTarget};
    mode in Go's bits), with no process started; None when it is missing or a parent is not a
    directory. docker-py has no call for the archive API's HEAD request, so its URL is made
    from the client's public base_url and api_version, as the SDK makes its own."""
    api = container.client.api
    url = f"{api.base_url}/v{api.api_version}/containers/{quote(container.id, safe='')}/archive"
    res = api.head(url, params={"path": path})
    if res.status_code != 200:
        return None
    return json.loads(base64.b64decode(res.headers.get(STAT_HEADER) or "e30="))


def is_dir(stat: dict | None) -> bool:
    return bool(stat) and bool(int(stat.get("mode", 0)) & DIR_BIT)


def _deepest_existing(container, path: str) -> tuple[str, dict | None, list[str]]:
    """The deepest existing path of `path` (itself when it exists), its stat (None for /), and
    the names below it that do not exist yet, outermost first."""
    current, missing = posixpath.normpath(path), []
    while current != "/":
        found = path_stat(container, current)
        if found is not None:
            return current, found, missing
        current, name = posixpath.split(current)
        missing.insert(0, name)
    return current, None, missing


def _folders_archive(names: list[str]) -> bytes:
    """A tar of nested empty folders names[0]/names[1]/..., owned by root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for depth in range(1, len(names) + 1):
            info = tarfile.TarInfo("/".join(names[:depth]))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, NEW_DIR_MODE, int(time.time())
            tar.addfile(info)
    return buf.getvalue()


def _put(container, path: str, data: bytes) -> None:
    try:
        accepted = container.client.api.put_archive(container.id, path, data)
    except docker.errors.NotFound as exc:  # removed meanwhile
        raise PathNotFound(f"{path} does not exist in the container: {exc.explanation}") from None
    except docker.errors.APIError as exc:
        if exc.status_code == 400:  # newer Engines' "extraction point is not a directory" (a race with the stat)
            raise NotADirectory(f"{path} is not a directory (or a parent of it is not): {exc.explanation}") from None
        raise
    if not accepted:
        raise DockerError(f"the container refused the archive for {path}")


def extract(container, path: str, data: bytes) -> None:
    """Extract a tar archive into the directory `path`, made first (with its missing parents)
    when it does not exist; NotADirectory when it, or the deepest existing parent, is a file."""
    existing, found, missing = _deepest_existing(container, path)
    if found is not None and not int(found.get("mode", 0)) & (DIR_BIT | LINK_BIT):  # a link: the Engine follows it
        raise NotADirectory(f"{existing} is not a directory" + (f", so {path} cannot be made" if missing else ""))
    if missing:
        _put(container, existing, _folders_archive(missing))
    _put(container, path, data)


def read(container, path: str, max_bytes: int) -> tuple[bytes, str]:
    """The tar archive of a file or directory and what it is ("file" or "directory");
    ArchiveTooLarge as soon as more than max_bytes have come (the rest is never read),
    PathNotFound when there is no such path."""
    try:
        stream, stat = container.client.api.get_archive(container.id, path, chunk_size=CHUNK)
    except docker.errors.NotFound:
        raise PathNotFound(f"{path} does not exist in the container") from None
    data = bytearray()
    try:
        for chunk in stream:
            data += chunk
            if len(data) > max_bytes:
                raise ArchiveTooLarge(f"the archive of {path} is larger than ARCHIVE_MAX_BYTES ({max_bytes} bytes)")
    finally:
        stream.close()  # stops reading: the rest of a too large archive stays in the Engine
    return bytes(data), "directory" if is_dir(stat) else "file"
