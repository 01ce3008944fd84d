"""Files into and out of a run's container (the runs API's archive routes), mixed into the runs
of both clients (ops.RunOps): raw tar archives (put_archive, get_archive) and, built on
them, Harbor's four transfers (upload_file, upload_dir, download_file, download_dir).

Each is a job like a tool call: the archive goes up in the PUT and is extracted by the run's
host; a download is read into the service first (POST .../archive/export, then the job's
archive). Every request is safe to send again (extracting the same archive twice, or reading
twice, leaves the same files), so retryable failures are retried. Local packing and unpacking:
tarballs.py.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from termpool.client import tarballs
from termpool.client.protocol import wait_job


def _split(remote: str) -> tuple[str, str]:
    """A remote file path's folder and name."""
    folder, name = posixpath.split(remote.rstrip("/") if remote != "/" else remote)
    if not name:
        raise ValueError(f"not a file path: {remote!r}")
    return folder or "/", name


def _below_top(name: str) -> str | None:
    """A directory archive's member name without its top folder (skipped itself)."""
    _, _, rest = name.partition("/")
    return rest or None


class ArchiveOps:
    """The archive operations of a run (self.id) driven by its pool (self._pool)."""

    def _wait_for(self, job_id: str):
        return (yield from wait_job(self._pool, job_id, self._pool.job_timeout))

    def _put(self, path: str, data: bytes):
        params = {"path": path}
        reply = yield from self._call(
            "PUT", f"/v1/runs/{self.id}/archive", params=params, content=data, idempotent=True
        )
        return (yield from self._wait_for(reply["job_id"]))["result"]

    def _get(self, path: str):
        """(the export job's result {size, path_type}, the tar bytes)."""
        body = {"path": path}
        reply = yield from self._call("POST", f"/v1/runs/{self.id}/archive/export", body=body, idempotent=True)
        job = yield from self._wait_for(reply["job_id"])
        data = yield from self._call("GET", f"/v1/jobs/{reply['job_id']}/archive", idempotent=True, raw_reply=True)
        return job["result"], data

    def put_archive(self, path: str, data: bytes):
        """Extract a tar archive into the container's directory `path` (made if missing),
        merging with what is there; the job's result {path, size}."""
        return (yield from self._put(path, data))

    def get_archive(self, path: str):
        """A file or directory of the container as a tar archive (bytes), as the Engine's
        archive API makes it: the top member is named after the path's last component."""
        return (yield from self._get(path))[1]

    def upload_file(self, local: str, remote: str):
        """Copy a local file (or symlink) to the container's path `remote` (its folder is made
        if missing), mode kept, owned by root."""
        folder, name = _split(remote)
        yield from self._put(folder, tarballs.pack_file(local, name))

    def upload_dir(self, local_dir: str, remote_dir: str):
        """Copy the contents of a local folder into the container's `remote_dir` (made if
        missing), merged with what is there: `docker cp local_dir/. ctr:remote_dir`."""
        yield from self._put(remote_dir, tarballs.pack_dir(local_dir))

    def download_file(self, remote: str, local: str):
        """Copy the container's file `remote` to the local path `local` (a symlink stays one)."""
        result, data = yield from self._get(remote)
        if result["path_type"] != "file":
            raise IsADirectoryError(f"{remote} is a directory in the container: use download_dir")
        target = Path(local)
        tarballs.unpack(data, target.parent, lambda name: target.name if "/" not in name else None)

    def download_dir(self, remote_dir: str, local_dir: str):
        """Copy the contents of the container's folder `remote_dir` into `local_dir` (made if
        missing), merged with what is there."""
        result, data = yield from self._get(remote_dir)
        if result["path_type"] != "directory":
            raise NotADirectoryError(f"{remote_dir} is not a directory in the container: use download_file")
        tarballs.unpack(data, local_dir, _below_top)
