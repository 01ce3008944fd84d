"""A fault injector for the Docker API: a unix-socket HTTP proxy in front of the real dockerd.

Workers started with DOCKER_HOST=unix://<proxy.sock> (the docker SDK and the compose CLI
alike) talk to the real engine through it. `fail(method, path_pattern, times)` makes the
next `times` matching requests answer 500 without reaching dockerd; `stall(method,
path_pattern, after_bytes)` forwards the next matching request but passes only the first
`after_bytes` bytes of dockerd's answer, then holds the rest (the connection stays open, as an
engine whose stream stopped midway leaves it) until the client goes away; everything else is
forwarded byte for byte. The proxy follows HTTP/1.1 request framing (Content-Length or
chunked bodies, no pipelining: Docker clients wait for each answer) so it can pick requests
out of kept-alive connections; after a request asking for a protocol upgrade (exec/attach
hijacking, BuildKit sessions) the connection is relayed raw both ways.
"""

from __future__ import annotations

import json
import re
import socket
import socketserver
import threading
from pathlib import Path

DOCKER_SOCKET = "/var/run/docker.sock"
VERSION_PREFIX = re.compile(r"^/v[0-9.]+(?=/)")
CHUNK = 65536


class FaultProxy:
    def __init__(self, path: Path, upstream: str = DOCKER_SOCKET):
        self.path = Path(path)
        self.upstream = upstream
        self._lock = threading.Lock()
        self._faults: list[list] = []  # [method, compiled pattern, remaining, bytes passed (None: fail)]
        self.requests: list[tuple[str, str]] = []  # (method, path without version or query), in order
        self.injected: list[tuple[str, str]] = []
        self._server: socketserver.ThreadingUnixStreamServer | None = None

    @property
    def docker_host(self) -> str:
        return f"unix://{self.path}"

    # ---- control --------------------------------------------------------------------------
    def fail(self, method: str, pattern: str, times: int = 1) -> None:
        """Answer 500 to the next `times` requests of `method` whose path fully matches `pattern`."""
        with self._lock:
            self._faults.append([method.upper(), re.compile(pattern), times, None])

    def stall(self, method: str, pattern: str, after_bytes: int, times: int = 1) -> None:
        """Stall dockerd's answer to the next `times` requests of `method` whose path fully
        matches `pattern` after its first `after_bytes` bytes (head included)."""
        with self._lock:
            self._faults.append([method.upper(), re.compile(pattern), times, after_bytes])

    def count(self, method: str, pattern: str) -> int:
        """Requests seen (failed or forwarded) of `method` whose path fully matches `pattern`."""
        rx = re.compile(pattern)
        with self._lock:
            return sum(1 for m, p in self.requests if m == method.upper() and rx.fullmatch(p))

    def _take_fault(self, method: str, path: str) -> tuple[bool, int | None]:
        """(whether a fault applies, the bytes to pass before a stall: None to answer 500)."""
        with self._lock:
            self.requests.append((method, path))
            for fault in self._faults:
                if fault[2] > 0 and fault[0] == method and fault[1].fullmatch(path):
                    fault[2] -= 1
                    self.injected.append((method, path))
                    return True, fault[3]
        return False, None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                proxy._serve(self.request)

        self.path.unlink(missing_ok=True)
        self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        self._server.daemon_threads = True
        self.path.chmod(0o666)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="fault-proxy").start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        self.path.unlink(missing_ok=True)

    # ---- one client connection ------------------------------------------------------------
    def _serve(self, client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(self.upstream)
        gate = _Gate()
        pump = threading.Thread(target=_relay_socket, args=(upstream, client, gate), daemon=True)
        pump.start()
        reader = client.makefile("rb")
        try:
            while True:
                head = _read_head(reader)
                if not head:
                    break
                method, target, headers = _parse_head(head)
                path = VERSION_PREFIX.sub("", target.split("?", 1)[0])
                faulty, stall_after = self._take_fault(method, path)
                if faulty and stall_after is not None:
                    gate.arm(stall_after)  # the answers before it were all relayed: clients wait for each
                    faulty = False
                if faulty:
                    _forward_body(reader, headers, None)
                    body = json.dumps({"message": f"fault injected by the test proxy: {method} {path}"}).encode()
                    client.sendall(
                        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                    )
                    continue
                upstream.sendall(head)
                _forward_body(reader, headers, upstream)
                if "upgrade" in headers or "upgrade" in headers.get("connection", "").lower():
                    _relay_reader(reader, upstream)  # raw both ways from now on
                    break
        except OSError:
            pass
        finally:
            gate.release()
            _shutdown(upstream)
            pump.join(timeout=30)
            reader.close()
            upstream.close()


def _read_head(reader) -> bytes:
    lines = []
    while True:
        line = reader.readline(CHUNK)
        if not line:
            return b""
        if not lines and line in (b"\r\n", b"\n"):
            continue  # stray CRLF between requests
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _parse_head(head: bytes) -> tuple[str, str, dict]:
    first, *rest = head.decode("latin-1").split("\r\n")
    method, target, _ = first.split(" ", 2)
    headers = {}
    for line in rest:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return method.upper(), target, headers


def _forward_body(reader, headers: dict, sink: socket.socket | None) -> None:
    """Copy one request body (Content-Length or chunked) to sink, or drop it when sink is None."""

    def send(data: bytes):
        if sink is not None and data:
            sink.sendall(data)

    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = reader.readline(CHUNK)
            send(size_line)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = reader.readline(CHUNK)
                    send(line)
                    if line in (b"\r\n", b"\n", b""):
                        return
            _copy(reader, size + 2, send)  # the chunk and its CRLF
        return
    _copy(reader, int(headers.get("content-length", "0") or 0), send)


def _copy(reader, n: int, send) -> None:
    while n > 0:
        data = reader.read(min(n, CHUNK))
        if not data:
            raise OSError("client went away mid-body")
        send(data)
        n -= len(data)


def _relay_reader(reader, sink: socket.socket) -> None:
    while True:
        data = reader.read1(CHUNK)
        if not data:
            return
        sink.sendall(data)


class _Gate:
    """How much more of dockerd's answers one connection relays: everything, until armed to
    pass a number of bytes and then hold the rest until released (the client went away)."""

    def __init__(self):
        self._left: int | None = None
        self._released = threading.Event()

    def arm(self, after_bytes: int) -> None:
        self._left = after_bytes

    def release(self) -> None:
        self._released.set()

    def passing(self, data: bytes) -> bytes:
        """What of `data` goes on (all of it until armed, then what the budget leaves)."""
        if self._left is None:
            return data
        passed = data[: self._left]
        self._left -= len(passed)
        return passed

    @property
    def holding(self) -> bool:
        return self._left == 0

    def hold(self) -> None:
        self._released.wait()


def _relay_socket(source: socket.socket, sink: socket.socket, gate: _Gate | None = None) -> None:
    try:
        while True:
            data = source.recv(CHUNK)
            if not data:
                break
            if gate is not None:
                data = gate.passing(data)
            if data:
                sink.sendall(data)
            if gate is not None and gate.holding:
                gate.hold()  # the stall: dockerd's answer stops here, the connection stays open
                break
    except OSError:
        pass
    _shutdown(sink)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
