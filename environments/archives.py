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
import threading
import time
from urllib.parse import quote

import docker.errors
import requests.exceptions

from poolcore.failures import DockerError, Failure, OperationTimeout

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


def _archive_url(api, container_id: str) -> str:
    """The archive API's URL, made from the client's public base_url and api_version as the
    SDK makes its own (docker-py has no call for its HEAD request, and its get_archive hides
    the response a deadline must be able to cut)."""
    return f"{api.base_url}/v{api.api_version}/containers/{quote(container_id, safe='')}/archive"


def path_stat(container, path: str) -> dict | None:
    """The Engine's stat of a path in the container ({name, size, mode, mtime, linkTarget};
    mode in Go's bits), with no process started; None when it is missing or a parent is not a
    directory."""
    res = container.client.api.head(_archive_url(container.client.api, container.id), params={"path": path})
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


def _open_archive(container, path: str, timeout: float):
    """The Engine's streamed answer to GET .../archive (what the SDK's get_archive sends), its
    errors raised as the SDK raises them; PathNotFound when there is no such path."""
    api = container.client.api
    try:
        res = api.get(
            _archive_url(api, container.id),
            params={"path": path},
            headers={"Accept-Encoding": "identity"},  # a plain tar, as the SDK asks (else dockerd gzips it)
            stream=True,
            timeout=timeout,
        )
    except requests.exceptions.Timeout:
        raise OperationTimeout(
            f"the Engine did not answer for {path} within ARCHIVE_READ_TIMEOUT ({timeout:g} s)"
        ) from None
    try:
        res.raise_for_status()
    except requests.exceptions.HTTPError as exc:
        res.close()
        if res.status_code == 404:
            raise PathNotFound(f"{path} does not exist in the container") from None
        raise docker.errors.create_api_error_from_http_exception(exc) from None
    return res


def read(container, path: str, max_bytes: int, timeout: float) -> tuple[bytes, str]:
    """The tar archive of a file or directory and what it is ("file" or "directory");
    ArchiveTooLarge as soon as more than max_bytes have come (the rest is never read),
    PathNotFound when there is no such path, OperationTimeout (TIMEOUT) when the whole stream
    has not come within `timeout` seconds: at the deadline the connection is shut from a timer,
    which ends a read blocked on an Engine whose stream stalled (a socket timeout would not:
    a stream that drips a byte now and then never trips it)."""
    deadline = time.monotonic() + timeout
    res = _open_archive(container, path, timeout)
    cut = threading.Event()

    def shut():
        cut.set()
        try:
            res.raw.shutdown()  # urllib3's own way to end a read blocked in another thread
        except (ValueError, RuntimeError, OSError):  # closed meanwhile: nothing left to end
            pass

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), shut)
    timer.daemon = True
    timer.start()
    data = bytearray()
    try:
        for chunk in res.raw.stream(CHUNK, decode_content=False):
            data += chunk
            if len(data) > max_bytes:
                raise ArchiveTooLarge(f"the archive of {path} is larger than ARCHIVE_MAX_BYTES ({max_bytes} bytes)")
    except Exception:
        if not cut.is_set():
            raise
    finally:
        timer.cancel()
        res.close()  # stops reading: the rest of the archive stays in the Engine
    if cut.is_set():  # a shut stream may end as if it were whole: what came is not the archive
        raise OperationTimeout(f"the archive of {path} did not come within ARCHIVE_READ_TIMEOUT ({timeout:g} s)")
    stat = res.headers.get(STAT_HEADER)
    return bytes(data), "directory" if is_dir(json.loads(base64.b64decode(stat)) if stat else None) else "file"
