"""The tp-session helper: build it on the host, install it in task containers.

tp-session (environments/helper/tp_session.c) is a small static binary that runs inside each client
container and keeps the shell sessions' state in files there (see the C source for its
protocol), so sessions survive restarts of every worker process.

`tp-session serve` is its optional daemon: started once per container, it answers tool calls
over a unix socket in CTL_DIR (a host directory bind-mounted there), which is much cheaper than a
`docker exec` per call. It lives in the container, so it too outlives the workers.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import requests

HELPER_DIR = Path(__file__).resolve().parent / "helper"
BUILD_SCRIPT = HELPER_DIR / "build.sh"
SOURCE = HELPER_DIR / "tp_session.c"
BINARY = HELPER_DIR / "tp-session"

# Paths inside the container.
HELPER_PATH = "/.termpool/bin/tp-session"
SESSIONS_ROOT = "/.termpool/sessions"
WORKSPACE = "/workspace"
CTL_DIR = "/.termpool/ctl"  # bind-mounted from the host (mode 1777): the serve socket lives here
CTL_SOCKET = f"{CTL_DIR}/ctl.sock"

log = logging.getLogger(__name__)

_lock = threading.Lock()
_cached: tuple[float, bytes] | None = None  # (mtime, binary bytes)


def helper_binary() -> Path:
    """The host path of the built helper; builds it with build.sh when missing or stale."""
    built = BINARY.is_file()
    if built and not (SOURCE.is_file() and SOURCE.stat().st_mtime > BINARY.stat().st_mtime):
        return BINARY
    if shutil.which("gcc") is None:
        if built:  # the source looks newer (a fresh checkout, say) but we cannot rebuild
            return BINARY
        raise RuntimeError(
            f"the tp-session helper is not built ({BINARY}) and gcc is not installed: "
            f"install gcc and libc6-dev, or run {BUILD_SCRIPT} where they are"
        )
    proc = subprocess.run(["sh", str(BUILD_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0 or not BINARY.is_file():
        raise RuntimeError(f"building the tp-session helper failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return BINARY


def _helper_bytes() -> bytes:
    global _cached
    path = helper_binary()
    mtime = path.stat().st_mtime
    with _lock:
        if _cached is None or _cached[0] != mtime:
            _cached = (mtime, path.read_bytes())
        return _cached[1]


def session_dir(sid: str) -> str:
    """The session's directory in the container: any client id becomes a safe file name."""
    encoded = sid.encode("utf-8", "surrogatepass").hex()
    if len(encoded) > 200:  # keep well under NAME_MAX (255)
        return f"{SESSIONS_ROOT}/h{hashlib.sha256(sid.encode('utf-8', 'surrogatepass')).hexdigest()}"
    return f"{SESSIONS_ROOT}/s{encoded}"


def container_user(container) -> str:
    """The container's configured user ("" when none: root)."""
    return ((container.attrs or {}).get("Config") or {}).get("User") or ""


def is_root(user: str) -> bool:
    return user.split(":", 1)[0] in ("", "root", "0")


_NUMERIC_USER = re.compile(r"^(\d+)(?::(\d+))?$")


def _tar_member(
    tar: tarfile.TarFile, name: str, mode: int, data: bytes | None = None, uid: int = 0, gid: int = 0
) -> None:
    info = tarfile.TarInfo(name)
    info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, int(time.time())
    if data is None:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def prepare_container(container, serve: bool = False) -> None:
    """Install the helper at HELPER_PATH, create SESSIONS_ROOT (mode 1777) and WORKSPACE.

    One put_archive; plus one exec (chown) only when the configured user is a name rather
    than a number, because the archive can only carry numeric owners. With `serve`, also start
    the helper's server on CTL_SOCKET (one more exec; see start_server); a server that cannot
    start is logged, not raised: the tools then fall back to one `docker exec` per call.
    """
    user = container_user(container)
    uid = gid = 0
    chown_by_name = False
    if not is_root(user):
        m = _NUMERIC_USER.match(user)
        if m:
            uid = int(m.group(1))
            gid = int(m.group(2)) if m.group(2) else 0
        else:
            chown_by_name = True
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        _tar_member(tar, ".termpool", 0o755)
        _tar_member(tar, ".termpool/bin", 0o755)
        _tar_member(tar, ".termpool/bin/tp-session", 0o755, _helper_bytes())
        _tar_member(tar, ".termpool/sessions", 0o1777)
        _tar_member(tar, WORKSPACE.lstrip("/"), 0o755, uid=uid, gid=gid)
    if not container.put_archive("/", buf.getvalue()):
        raise RuntimeError("could not install the tp-session helper in the container")
    if chown_by_name:
        result = container.exec_run(["chown", user, WORKSPACE], user="root")
        if result.exit_code != 0:
            raise RuntimeError(
                f"chown {user} {WORKSPACE} failed: {(result.output or b'').decode('utf-8', 'replace').strip()}"
            )
    if serve:
        try:
            start_server(container)
        except Exception as exc:
            if isinstance(exc, requests.exceptions.ConnectionError):
                raise  # Docker unreachable: the caller's business
            log.warning("tp-session serve did not start in %s: %s", container.id, exc)


def start_server(container) -> None:
    """Start `tp-session serve CTL_SOCKET` in the container; returns once it is listening.

    No `user=`: the server, and so every command it runs, is the container's configured user,
    exactly as a plain `docker exec` would be. A server already running makes this a no-op. The
    server detaches itself, so the exec ends at once; it prints only when it fails.
    """
    api = container.client.api
    exec_id = api.exec_create(container.id, [HELPER_PATH, "serve", CTL_SOCKET], stdout=True, stderr=True)["Id"]
    out = api.exec_start(exec_id)
    if out:
        error = HelperNotStarted if exec_never_started(api, exec_id) else RuntimeError
        raise error(out.decode("utf-8", "replace").strip())


class HelperNotStarted(RuntimeError):
    """Docker could not start the helper in the container (not installed, or its working
    directory is gone); the exec's output is Docker's reason."""


def exec_never_started(api, exec_id: str) -> bool:
    """Whether Docker failed to start the exec's process. Docker reports that inside the
    output stream (the connection is hijacked by then), so it is read from the exec's state:
    exit code 126 and no process id."""
    state = api.exec_inspect(exec_id)
    return state.get("ExitCode") == 126 and not state.get("Pid")
