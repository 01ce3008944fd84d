"""The tp-session helper: build it on the host, install it in task containers.

tp-session (environments/helper/tp_session.c) is a small static binary that runs inside each client
container and keeps the shell sessions' state in files there (see the C source for its
protocol), so sessions survive restarts of every worker process.

`tp-session serve` is its optional daemon: started once per container, it answers tool calls
over a unix socket in CTL_DIR (a host directory bind-mounted there), which is much cheaper than a
`docker exec` per call. It lives in the container, so it too outlives the workers. A root
container starts it itself, with `tp-session boot` as its entrypoint (boot_entrypoint); other
containers get it from an exec (prepare_container).

A run's containers get the helper through a read-only bind mount at BIN_DIR of a host folder of
the run's own (helper_dir) holding a hard link to this version's binary: nothing is copied per
start, the task cannot change it, and a worker can update it for that run alone. A container
started without that mount (by an older termpool, or a test) gets it copied in by put_archive.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import requests

from poolcore.task_spec import load_task_cached

HELPER_DIR = Path(__file__).resolve().parent / "helper"
BUILD_SCRIPT = HELPER_DIR / "build.sh"
SOURCE = HELPER_DIR / "tp_session.c"
BINARY = HELPER_DIR / "tp-session"

# Paths inside the container.
BIN_DIR = "/.termpool/bin"
HELPER_PATH = f"{BIN_DIR}/tp-session"
SESSIONS_ROOT = "/.termpool/sessions"
WORKSPACE = "/workspace"
CTL_DIR = "/.termpool/ctl"  # bind-mounted from the host (mode 1777): the serve socket lives here
CTL_SOCKET = f"{CTL_DIR}/ctl.sock"

HELPER_DIR_SUFFIX = ".bin"  # the host folder mounted at BIN_DIR: <the run's ctl folder>.bin
VERSIONS_DIR = ".helper"  # under the socket folder: one file per helper version, linked into runs' folders

log = logging.getLogger(__name__)

_lock = threading.Lock()
_cached: tuple[float, bytes, str] | None = None  # (mtime, binary bytes, version: a digest of them)


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
    return _helper_build()[1]


def _helper_build() -> tuple[float, bytes, str]:
    global _cached
    path = helper_binary()
    mtime = path.stat().st_mtime
    with _lock:
        if _cached is None or _cached[0] != mtime:
            data = path.read_bytes()
            _cached = (mtime, data, hashlib.sha256(data).hexdigest()[:16])
        return _cached


def _current_helper(socket_dir: Path) -> Path:
    """This version's binary under socket_dir (written once, atomically: workers of several
    versions may share the folder)."""
    _, data, digest = _helper_build()
    path = socket_dir / VERSIONS_DIR / f"tp-session-{digest}"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    return path


def helper_dir(ctl_dir: Path) -> Path:
    """The host folder a run's containers see read-only at BIN_DIR, next to its ctl folder
    (socket_dir/<owner>), with the current helper in it."""
    path = Path(f"{ctl_dir}{HELPER_DIR_SUFFIX}")
    path.mkdir(mode=0o755, exist_ok=True)
    os.chmod(path, 0o755)
    _link_current(path, _current_helper(ctl_dir.parent))
    return path


def _link_current(folder: Path, current: Path) -> None:
    """folder/tp-session becomes (a hard link to) `current`, replaced atomically; a copy where
    the file system refuses links."""
    target = folder / "tp-session"
    try:
        if os.stat(target).st_ino == os.stat(current).st_ino:
            return
    except FileNotFoundError:
        pass
    tmp = folder / f".tmp-{os.getpid()}-{threading.get_ident()}"
    tmp.unlink(missing_ok=True)
    try:
        os.link(current, tmp)
    except OSError:
        shutil.copyfile(current, tmp)
        os.chmod(tmp, 0o755)
    os.replace(tmp, target)


def helper_mount(ctl_dir: Path) -> str:
    """The bind ("host:BIN_DIR:ro") that gives a run's containers the helper."""
    return f"{helper_dir(ctl_dir)}:{BIN_DIR}:ro"


def remove_helper_dir(ctl_dir: str) -> None:
    if ctl_dir:
        shutil.rmtree(f"{ctl_dir}{HELPER_DIR_SUFFIX}", ignore_errors=True)


def mounted_helper_dir(container) -> str | None:
    """The host folder mounted at BIN_DIR in the container, or None (the helper is copied in)."""
    mounts = (container.attrs or {}).get("Mounts")
    if mounts is None:  # a container known by name only (docker_client.KnownContainer)
        mounts = container.client.api.inspect_container(container.id).get("Mounts") or []
    return next((m.get("Source") for m in mounts if m.get("Destination") == BIN_DIR), None)


def session_dir(sid: str) -> str:
    """The session's directory in the container: any client id becomes a safe file name."""
    encoded = sid.encode("utf-8", "surrogatepass").hex()
    if len(encoded) > 200:  # keep well under NAME_MAX (255)
        return f"{SESSIONS_ROOT}/h{hashlib.sha256(sid.encode('utf-8', 'surrogatepass')).hexdigest()}"
    return f"{SESSIONS_ROOT}/s{encoded}"


def container_user(container) -> str:
    """The container's configured user ("" when none: root)."""
    return ((container.attrs or {}).get("Config") or {}).get("User") or ""


def session_workdir(task_dir: Path | str, container) -> str:
    """Where a run's tool sessions start. A Harbor task: where Harbor's exec starts, as Harbor's own
    agents see the task ([environment] workdir, else the container's working directory, else /).
    A task of the original format: "" (WORKSPACE, the reference's)."""
    harbor = load_task_cached(task_dir).harbor
    if harbor is None:
        return ""
    return harbor.workdir or ((container.attrs or {}).get("Config") or {}).get("WorkingDir") or "/"


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


def _owner(user: str) -> tuple[int, int, bool]:
    """(uid, gid, by_name) of /workspace for the container's user: numeric ids an archive can
    carry, by_name when the user is a name that only the container's chown can resolve."""
    if is_root(user):
        return 0, 0, False
    m = _NUMERIC_USER.match(user)
    if m:
        return int(m.group(1)), int(m.group(2)) if m.group(2) else 0, False
    return 0, 0, True


def prepare_container(container, serve: bool = False) -> None:
    """Give the container the helper at HELPER_PATH, SESSIONS_ROOT (mode 1777) and WORKSPACE
    (owned by the container's user); with `serve`, start the helper's server on CTL_SOCKET.

    A mounted helper (helper_mount) costs one exec for a root container: `tp-session setup`
    makes the folders and becomes the server. Otherwise one put_archive (with the binary, unless
    mounted), one exec (chown) only when the configured user is a name rather than a number
    (the archive can only carry numeric owners), and with `serve` one more exec (start_server).
    A server that cannot start is logged, not raised: the tools then fall back to one `docker
    exec` per call.
    """
    user = container_user(container)
    uid, gid, chown_by_name = _owner(user)
    mounted = mounted_helper_dir(container)
    if mounted:
        _link_current(Path(mounted), _current_helper(Path(mounted).parent))  # an older version: this one
        if is_root(user):
            _setup_as_root(container, serve)
            return
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        _tar_member(tar, ".termpool", 0o755)
        if not mounted:
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


SETUP_FAILED = b"tp-session: setup: "
# setup's arguments for a root container (uid and gid 0), by exec and by boot alike.
_ROOT_SETUP = (SESSIONS_ROOT, WORKSPACE, "0", "0")


def _setup_as_root(container, serve: bool) -> None:
    """One exec as the (root) container user: the folders, then, with `serve`, the server in
    the same process (its command line is the one start_server gives it)."""
    argv = [HELPER_PATH, "setup", *_ROOT_SETUP]
    if not serve:
        out = container.exec_run(argv).output or b""
        if out:
            raise RuntimeError(f"could not prepare the container: {out.decode('utf-8', 'replace').strip()}")
        return
    argv += ["--", "serve", CTL_SOCKET]
    api = container.client.api
    exec_id = api.exec_create(container.id, argv, stdout=True, stderr=True)["Id"]
    out = api.exec_start(exec_id)
    if out.startswith(SETUP_FAILED) or (out and exec_never_started(api, exec_id)):
        raise RuntimeError(f"could not prepare the container: {out.decode('utf-8', 'replace').strip()}")
    if out:  # the folders are there; only the server failed
        log.warning("tp-session serve did not start in %s: %s", container.id, out.decode("utf-8", "replace").strip())


def boot_entrypoint() -> list[str]:
    """The entrypoint that starts a root container's tool server (setup, then serve on
    CTL_SOCKET) before its own command, given after it: the start then needs no exec."""
    return [HELPER_PATH, "boot", *_ROOT_SETUP, CTL_SOCKET, "--"]


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
