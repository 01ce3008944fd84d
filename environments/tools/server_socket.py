"""The client side of the tp-session server's unix socket (protocol: cmd_serve in
environments/helper/tp_session.c), and the restart of a server that stopped answering."""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import time

from environments.session_helper import HelperNotStarted, prepare_container, start_server

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 2.0  # a live server accepts at once (the kernel queues the connection)
REPLY_MAX = 64 << 20  # beyond this the reply is cut (the helper stops at the closed socket)
RESTART_EVERY = 5.0  # seconds between restarts of one socket's server
FIRST_SERVER_WAIT = 5.0  # how long a call waits for a just-started run's server (see below)


def _wire(text: str) -> bytes:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: U+FFFD, what docker's JSON decoding makes of them
        data = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
    if b"\0" in data:
        raise ValueError("embedded null byte")
    return data


def encode_request(args, workdir, environment) -> bytes:
    """One helper invocation as the server reads it: working directory, environment, argv."""
    fields = [workdir or "", *(f"{k}={v}" for k, v in (environment or {}).items()), "", *args]
    payload = b"".join(_wire(f) + b"\0" for f in fields)
    return b"TPS1" + struct.pack(">I", len(payload)) + payload


def _connect(sock: socket.socket, path: str) -> None:
    if len(os.fsencode(path)) < 100:
        sock.connect(path)
        return
    # Longer than sun_path holds: reach it through an O_PATH descriptor of its directory.
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def ask_server(path: str, request: bytes, stdin: bytes = b"") -> bytes | None:
    """The helper's reply through the server at `path`; None when the request certainly never
    ran (no socket, no server, or a reset before any reply: the kernel dropped the connection
    with the request unread), so the caller may send it another way. A reply that is simply
    empty (the helper was killed after it took the request) is returned as such, never retried."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            _connect(sock, path)
            # No read timeout: a blocking command may run `timeout` seconds, or without limit.
            sock.settimeout(None)
            sock.sendall(request + stdin)
            sock.shutdown(socket.SHUT_WR)  # end of the helper's stdin
        except OSError:
            return None
        reply = bytearray()
        while len(reply) < REPLY_MAX:
            try:
                chunk = sock.recv(min(1 << 20, REPLY_MAX - len(reply)))
            except ConnectionResetError:
                if not reply:
                    return None
                break  # a refusal that left part of the request unread: its message came first
            if not chunk:
                break
            reply += chunk
        return bytes(reply)
    finally:
        sock.close()


def wait_for_first_server(path: str, limit: float = FIRST_SERVER_WAIT) -> bool:
    """True once a server listens at `path` when none ever did there (no socket, no lock
    file): a run's start replies once its container runs, which may be before the server that
    tp-session boot starts in it listens, and waiting for it beats a docker exec plus a second
    server start. False at once for a server that was there and went (its socket or lock file
    stays), or after `limit` seconds."""
    if os.path.exists(path):
        return False  # a socket nobody answers at: its server is gone
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if os.path.exists(path + ".lock") or time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def server_answers(path: str) -> bool:
    """A server listens at `path`: the kernel takes a connection (the container it runs in is
    up), with no Docker call. The server drops the empty request at once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        _connect(sock, path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def unprepared(out: bytes) -> bool:
    """The server's own refusal (tp_session.c, cmd_serve) when /workspace or the helper is gone."""
    return (
        out.startswith((b"tp-session: chdir ", b"tp-session: cannot run the helper "))
        and b"No such file or directory" in out.split(b"\n", 1)[0]
    )


_restart_lock = threading.Lock()
restarts_asked: dict[str, float] = {}


def restart_server(container, path: str) -> None:
    """(Re)start the container's server in a background thread, at most every few seconds per
    socket: the call that found it gone has already been served by docker exec."""
    now = time.monotonic()
    with _restart_lock:
        if now - restarts_asked.get(path, -math.inf) < RESTART_EVERY:
            return
        if len(restarts_asked) > 1000:  # one entry per socket ever restarted: forget the old ones
            for key in [k for k, t in restarts_asked.items() if now - t >= RESTART_EVERY]:
                del restarts_asked[key]
        restarts_asked[path] = now

    def restart():
        try:
            try:
                start_server(container)
            except HelperNotStarted:
                prepare_container(container, serve=True)  # the helper is missing: install it too
        except Exception as exc:
            log.warning("restarting tp-session serve for %s failed: %s", path, exc)

    threading.Thread(target=restart, name="tp-serve-restart", daemon=True).start()
