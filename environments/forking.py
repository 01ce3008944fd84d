"""The Docker side of a fork: commit every service of a live run, carry its shell sessions over,
remove committed images nobody needs, and find out whether this host can carry processes.

A fork commits each service container of the source (`docker commit`, the container paused for
the moment it takes, so its files are one instant) into an image labelled FORK_LABEL and
FORK_HOST_LABEL; the children's containers start from those images (lifecycle.start's
`images`). Named and anonymous volumes and bind mounts are not part of a container's image,
so what a service keeps there is not carried (docs/http-api.md, "Forking a run").

Shell sessions: tp-session keeps each session's files (output, pid, exit status) under
SESSIONS_ROOT in the container, so they are in the commit. A session whose command still runs
is carried as its working directory (/proc/<pid>/cwd), the environment the command was started
with (/proc/<pid>/environ) and its command line: without process carry the child starts that
command again there (`processes: "restarted"`). With it (environments/checkpoints.py) the
child's processes are the source's, restored (`processes: "carried"`).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import docker.errors

from environments.docker_client import docker_client
from environments.session_helper import session_dir
from environments.tools.transport import HelperTransport

FORK_LABEL = "termpool.fork.source"  # the run an image was committed from
FORK_HOST_LABEL = "termpool.fork.host"
FORK_REPOSITORY = "termpool-fork"
DIRECT_CLIENT = ""  # the service key of a run started without compose: its one container
CRIU_MIN = (4, 2)  # older CRIU fails on this kernel's vDSO layout (3.17) or socket options (4.1)
RUNC_CRIU_CONF = Path("/etc/criu/runc.conf")  # CRIU options runc adds to every checkpoint and restore
CRIU_OPTIONS = ("file-locks",)  # tp-session holds flock locks: CRIU refuses to dump them without it

log = logging.getLogger(__name__)

# One exec per running session, as root: the command's cwd, environment and argv. The session's
# pid file holds "<supervisor pid> <its start time> <command pid>"; no rc file: still running.
# The task can write that file: only a number is taken, so what is read is a process's own
# /proc entries (bounded by the kernel), never a file the task made as large as it likes.
_CAPTURE = (
    'read s t p < "$1/pid" 2>/dev/null || exit 1; case "$p" in ""|*[!0-9]*) exit 1;; esac; '
    '[ ! -e "$1/rc" ] && cd "/proc/$p/cwd" 2>/dev/null '
    '&& pwd -P && cat "/proc/$p/environ" && printf "\\001" && cat "/proc/$p/cmdline"'
)


# ---- the source's containers ----------------------------------------------------------------
def service_containers(env: dict) -> dict:
    """A run's containers by service: every container of its compose project, or its one
    container (DIRECT_CLIENT) when it was started without compose."""
    client = docker_client()
    if env.get("mode") != "compose":
        return {DIRECT_CLIENT: client.containers.get(env["client"])}
    found = client.containers.list(
        all=True, filters={"label": f"com.docker.compose.project={env['project']}"}, ignore_removed=True
    )
    return {c.labels.get("com.docker.compose.service", c.name): c for c in found}


def image_names(source: str, nonce: str, services) -> dict:
    """The committed image's name of each service: FORK_REPOSITORY:<source>-<nonce>-<service>."""
    names = {}
    for service in services:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", service or "client")[:60]
        names[service] = f"{FORK_REPOSITORY}:{source}-{nonce}-{stem}"
    return names


def commit(containers: dict, names: dict, source: str, host: str, pause: bool = True) -> None:
    """Commit each service container into its image, labelled with its source run and host
    (pause=False: the caller has paused them already)."""
    changes = [f"LABEL {FORK_LABEL}={source}", f"LABEL {FORK_HOST_LABEL}={host}"]
    for service, container in containers.items():
        repository, tag = names[service].split(":", 1)
        container.commit(repository=repository, tag=tag, pause=pause, changes=changes)


def remove_images(images) -> list[str]:
    """Remove these committed images; those still in use (a container not yet gone) are left
    for the reconcile. Returns the images removed or already gone."""
    gone = []
    for image in images:
        try:
            docker_client().images.remove(image)
            gone.append(image)
        except docker.errors.ImageNotFound:
            gone.append(image)
        except docker.errors.APIError as exc:
            if exc.status_code != 409:
                raise
            log.info("fork image %s is still in use: the reconcile removes it later", image)
    return gone


def host_images(host: str) -> list[str]:
    """The committed fork images of this host, by name."""
    found = docker_client().images.list(filters={"label": f"{FORK_HOST_LABEL}={host}"})
    return sorted(tag for image in found for tag in image.tags if tag.startswith(f"{FORK_REPOSITORY}:"))


# After a restore each carried session's supervisor runs under its old pid but with a new start
# time (the kernel's, not restorable), which tp-session compares to tell a live session from a
# reused pid: the pid file gets the new one. Only a numeric pid's own /proc entry is read.
_REFRESH = (
    'for d in "$@"; do read s t p < "$d/pid" 2>/dev/null || continue; case "$s" in ""|*[!0-9]*) continue;; esac; '
    'n=$(sed "s/.*) //" "/proc/$s/stat" 2>/dev/null | cut -d" " -f20); case "$n" in ""|*[!0-9]*) continue;; esac; '
    'printf "%s %s %s\\n" "$s" "$n" "$p" > "$d/pid.new" && mv -f "$d/pid.new" "$d/pid"; done'
)

# The restored tool server of a carried child: found by the lock file it holds open (only the
# server holds it) and stopped, so a new one can take the lock at once.
_STOP_SERVER = (
    'for d in /proc/[0-9]*; do for f in "$d"/fd/*; do '
    'if [ "$(readlink "$f" 2>/dev/null)" = "$1" ]; then kill "${d#/proc/}"; break; fi; done; done'
)


# ---- shell sessions -------------------------------------------------------------------------
def capture_sessions(container, sids) -> dict:
    """The sessions (by id) whose command still runs: cwd, environment and argv of each."""
    captured = {}
    for sid in sids:
        result = container.exec_run(["sh", "-c", _CAPTURE, "sh", session_dir(sid)], user="root", demux=False)
        out = result.output or b""
        if result.exit_code != 0 or b"\n" not in out or b"\x01" not in out:
            continue  # ended, or never ran as a session of its own
        cwd, _, rest = out.partition(b"\n")
        environ, _, cmdline = rest.partition(b"\x01")
        argv = [a.decode("utf-8", "surrogateescape") for a in cmdline.split(b"\0") if a]
        if not argv:
            continue
        env = dict(
            item.decode("utf-8", "surrogateescape").split("=", 1) for item in environ.split(b"\0") if b"=" in item
        )
        captured[sid] = {"cwd": cwd.decode("utf-8", "surrogateescape"), "env": env, "argv": argv}
    return captured


def refresh_sessions(container, sids) -> None:
    """Carried sessions (restored, not restarted): their pid files get their supervisors' new
    start times, so tp-session sees them running."""
    if sids:
        dirs = [session_dir(sid) for sid in sids]
        result = container.exec_run(["sh", "-c", _REFRESH, "sh", *dirs], user="root")
        if result.exit_code != 0:
            log.warning("carried sessions of %s: %s", container.name, (result.output or b"")[-300:])


def stop_restored_server(container, lock_path: str) -> None:
    """Stop the carried tool server (it would quit on its own within a second: its socket file
    is not the one it made)."""
    container.exec_run(["sh", "-c", _STOP_SERVER, "sh", lock_path], user="root")


def restart_sessions(container, ctl_socket: str, captured: dict, kinds: dict, limit: int) -> list[str]:
    """Start each captured session's command again in the child, in its directory with its
    environment, under the same session id (its output starts empty). An interactive session
    gets a terminal again, a blocking one that had timed out does not. The ids restarted."""
    helper = HelperTransport(container, ctl_socket or None)
    restarted = []
    for sid, facts in captured.items():
        pty = "1" if kinds.get(sid) == "interactive" else "0"
        args = ["spawn", session_dir(sid), pty, "-", "--limit", str(limit), "--", *facts["argv"]]
        head, _ = helper.call(args, workdir=facts["cwd"], environment=facts["env"])
        if head and head[0] in ("started", "exists"):
            restarted.append(sid)
        else:
            log.warning("session %s was not restarted in %s: %s", sid, container.name, " ".join(head))
    return restarted


# ---- process carry --------------------------------------------------------------------------
def process_carry(setting: str) -> tuple[bool, str]:
    """Whether this host's forks carry processes, and why or why not (shown per host in
    /status). Carrying needs CRIU >= CRIU_MIN on PATH (the worker's, which must be dockerd's
    too: runc runs `criu` from it) and a dockerd with experimental features (checkpoints)."""
    if setting == "off":
        return False, "FORK_PROCESSES=off"
    criu = shutil.which("criu")
    if criu is None:
        return False, "criu is not on PATH"
    try:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"criu --version failed: {exc}"
    match = re.search(r"Version:\s*(\d+)\.(\d+)", out)
    if not match or (int(match[1]), int(match[2])) < CRIU_MIN:
        found = f"{match[1]}.{match[2]}" if match else "of unknown version"
        return False, f"criu {found} is older than {'.'.join(map(str, CRIU_MIN))}"
    info = docker_client().info()
    if not info.get("ExperimentalBuild"):
        return False, "dockerd runs without --experimental (no checkpoints)"
    init = shutil.which(info.get("InitBinary") or "docker-init")
    if init and Path(init).is_symlink():  # CRIU restores the bind mount of a symlink as the link
        return False, f"dockerd's docker-init is a symlink: start dockerd with --init-path {Path(init).resolve()}"
    conf = RUNC_CRIU_CONF.read_text().split() if RUNC_CRIU_CONF.exists() else []
    if missing := [option for option in CRIU_OPTIONS if option not in conf]:
        return False, f"{RUNC_CRIU_CONF} lacks the CRIU option {', '.join(missing)}"
    return True, f"criu {match[1]}.{match[2]} and dockerd checkpoints: processes of every service are carried"
