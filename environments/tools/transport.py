"""How a tool call reaches tp-session in a container: through its server's unix socket when
there is one (a few milliseconds), else one `docker exec` (tens of milliseconds); files also
through Docker's archive API."""

from __future__ import annotations

import contextlib
import io
import tarfile
import time
from typing import NamedTuple

import docker.errors

from environments import archives
from environments.docker_client import says_not_running
from environments.session_helper import HELPER_PATH, exec_never_started, prepare_container
from environments.tools.server_socket import (
    ask_server,
    encode_request,
    restart_server,
    unprepared,
    wait_for_first_server,
)
from poolcore.failures import ContainerLost

# What a helper from before the output limits says to today's spawn arguments.
_OLD_SPAWN_USAGE = b"tp-session: usage: spawn DIR PTY(0|1) WAIT(-|seconds) -- argv..."


class Reply(NamedTuple):
    out: bytes  # stdout (through the server: stdout and stderr merged)
    err: bytes
    started: bool  # False when Docker could not start the helper (`out` is then Docker's reason)


class HelperTransport:
    """tp-session in one container. `ctl_socket` is the host path of its server's socket
    (prepare_container(serve=True)); when nobody answers there, the call goes through `docker
    exec` and the server is restarted in the background."""

    def __init__(self, container, ctl_socket: str | None):
        self.container = container
        self.ctl_socket = ctl_socket

    def call(
        self, args: list[str], *, workdir: str | None = None, environment: dict | None = None
    ) -> tuple[list[str], bytes]:
        """Run tp-session; returns its header line's fields and the raw bytes after it."""
        reply = self.run(args, workdir, environment)
        if (reply.err or reply.out).startswith(_OLD_SPAWN_USAGE):
            # A helper from before the output limits (a container that outlived an upgrade of
            # the workers): install the current one, whose arguments these are, and retry.
            prepare_container(self.container)
            reply = self.run(args, workdir, environment)
        out, err = reply.out, reply.err
        head, newline, body = out.partition(b"\n")
        if not reply.started or not newline or not head or out.startswith(b"tp-session: "):
            detail = (err or out).decode("utf-8", "replace").strip(". \n")
            raise RuntimeError(f"tp-session {args[0]} failed: {detail or 'no output'}")
        return head.decode("ascii", "replace").split(), body

    def run(self, args: list[str], workdir: str | None = None, environment: dict | None = None) -> Reply:
        """Run tp-session in the container; its stdout and stderr (both in the first through
        the server, which merges them)."""
        if self.ctl_socket:
            request = encode_request(args, workdir, environment)
            out = ask_server(self.ctl_socket, request)
            if out is None and wait_for_first_server(self.ctl_socket):
                out = ask_server(self.ctl_socket, request)
            if out is not None and unprepared(out):
                prepare_container(self.container)  # /workspace or the helper was removed
                out = ask_server(self.ctl_socket, request)
            if out == b"":  # the server went mid-call: with its container (a Docker restart)?
                self.require_running()
            if out is not None:
                return Reply(out, b"", True)
            try:
                return self.run_exec(args, workdir, environment)
            finally:
                restart_server(self.container, self.ctl_socket)
        return self.run_exec(args, workdir, environment)

    def run_exec(self, args, workdir, environment) -> Reply:
        argv = [HELPER_PATH, *args]
        reply = self._exec(argv, workdir, environment)
        if not reply.started:
            prepare_container(self.container)  # a container nobody prepared: do it now, once
            reply = self._exec(argv, workdir, environment)
        return reply

    def _exec(self, argv, workdir, environment) -> Reply:
        # The low-level API: exec_run inspects the exec too, but keeps only its exit code, which
        # does not tell a helper that never started from one that exited 126.
        api = self.container.client.api
        try:
            exec_id = api.exec_create(
                self.container.id, argv, stdout=True, stderr=True, workdir=workdir, environment=environment
            )["Id"]
        except docker.errors.APIError as exc:
            if exc.status_code in (404, 409):  # no such container, or it does not run
                self.require_running(exc)
            raise
        out, err = api.exec_start(exec_id, demux=True)
        return Reply(out or b"", err or b"", not exec_never_started(api, exec_id))

    def require_running(self, refusal: Exception | None = None) -> None:
        """ContainerLost unless the container runs (asked now, unless Docker's `refusal` of a
        call said it does not: says_not_running): a stopped container takes no call, and a
        tool error observation would hide that the run is over."""
        running = False
        if not says_not_running(refusal):
            with contextlib.suppress(docker.errors.NotFound):
                running = self.container.client.api.inspect_container(self.container.id)["State"]["Running"]
        if not running:
            raise ContainerLost(f"the run's container {self.container.id} no longer runs")

    def put_file(self, path: str, data: bytes) -> tuple[str, str] | None:
        """Write a file through the server (`tp-session put`): (status, reason); None when there
        is no server to ask (it is restarted in the background)."""
        if not self.ctl_socket:
            return None
        out = ask_server(self.ctl_socket, encode_request(["put", path], None, None), data)
        if out is None:
            self.require_running()  # else the archive API would write into a stopped container
            restart_server(self.container, self.ctl_socket)
            return None
        status, _, reason = out.decode("utf-8", "replace").partition("\n")[0].partition(" ")
        return status, reason

    def put_archive_file(self, path: str, data: bytes, uid: int, gid: int) -> None:
        """Write a file (mode 0644, owned by uid:gid) with one put_archive; Docker creates
        missing parents as root and replaces whatever is at `path`."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), 0o644, uid, gid, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive("/", buf.getvalue()):
            raise OSError("the container refused the archive")

    def is_directory(self, path: str) -> bool:
        """Stat a path through the archive API's HEAD request: no process is started. Missing,
        or a parent that is not a directory, is False: put_archive then says why."""
        return archives.is_dir(archives.path_stat(self.container, path))
