"""A CRIU new enough for process carry (>= 4.2), set up once per machine for the tests.

bookworm's CRIU 3.17 fails on this kernel (vDSO layout) and 4.1 on socket options; Debian
unstable's 4.2 works but needs a newer glibc than bookworm's. So its packages (criu, libc6 and
the libraries it links) are fetched with apt-get from Debian unstable through a private apt
configuration under CACHE (the machine's own sources stay as they are: the unstable source is
the machine's Debian source with its suite changed), unpacked there with dpkg-deb, and run with
their own loader through a wrapper named `criu` in CACHE/bin: put that folder first on a
dockerd's PATH and runc finds it. runc gives CRIU the options in RUNC_CRIU_CONF (the file runc
reads for every checkpoint and restore); ensure() adds `file-locks` there, which tp-session's
locks need (docs/operations.md, "Process carry"). `ensure()` returns that folder, or raises CriuUnavailable
with the reason (no Debian source, no network, no package): the test skips with it.

Usage: python3 -m devstack.criu   (prints the folder to put on PATH)
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
from pathlib import Path

from environments.forking import CRIU_OPTIONS, RUNC_CRIU_CONF

CACHE = Path("/var/cache/termpool-criu")
SYSTEM_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
SUITE = "sid"
LIBS = "usr/lib/x86_64-linux-gnu"


class CriuUnavailable(RuntimeError):
    """CRIU 4.2 could not be set up on this machine; the message says why."""


def ensure(cache: Path = CACHE) -> Path:
    """The folder holding the `criu` wrapper (set up on first use, under a lock)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        wrapper = cache / "bin" / "criu"
        if not (cache / ".ok").exists():
            _set_up(cache)
            (cache / ".ok").write_text(version(wrapper) + "\n")
        runc_options()
        return wrapper.parent


def dockerd_args() -> list[str]:
    """The dockerd options process carry needs besides --experimental: docker-init by its real
    path (Debian's is a symlink, whose bind mount CRIU cannot restore)."""
    init = shutil.which("docker-init")
    return ["--init-path", str(Path(init).resolve())] if init else []


def runc_options(conf: Path = RUNC_CRIU_CONF) -> None:
    """Add the CRIU options termpool needs to runc's CRIU configuration (kept if there)."""
    lines = conf.read_text().splitlines() if conf.exists() else []
    missing = [option for option in CRIU_OPTIONS if option not in (line.strip() for line in lines)]
    if missing:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("\n".join([*lines, *missing]) + "\n")


def version(criu: Path) -> str:
    """`criu --version`'s version number, or CriuUnavailable."""
    out = subprocess.run([str(criu), "--version"], capture_output=True, text=True, timeout=30)
    match = re.search(r"Version:\s*([\d.]+)", out.stdout)
    if out.returncode != 0 or not match:
        raise CriuUnavailable(f"the unpacked criu does not run: {(out.stderr or out.stdout).strip()[-300:]}")
    return match[1]


def _set_up(cache: Path) -> None:
    for part in ("apt", "debs", "root", "bin"):
        shutil.rmtree(cache / part, ignore_errors=True)
    apt = _apt_options(cache)
    _run(["apt-get", *apt, "update"], "apt-get update of Debian unstable")
    (cache / "debs").mkdir()
    _run(["apt-get", *apt, "download", *_packages(apt)], "apt-get download", cwd=cache / "debs")
    for deb in sorted((cache / "debs").glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(cache / "root")], f"dpkg-deb -x {deb.name}")
    root = cache / "root"
    (cache / "bin").mkdir()
    wrapper = cache / "bin" / "criu"
    wrapper.write_text(
        f'#!/bin/sh\nexec {root}/{LIBS}/ld-linux-x86-64.so.2 --library-path {root}/{LIBS} {root}/usr/sbin/criu "$@"\n'
    )
    wrapper.chmod(0o755)


def _packages(apt: list[str]) -> list[str]:
    """criu and every package it needs, recursively (libc6 included: the private status file
    lists nothing installed)."""
    deps = ["--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances"]
    argv = ["apt-cache", *apt, "depends", "--recurse", *deps, "criu"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    names = sorted({line for line in out.stdout.splitlines() if line and not line.startswith((" ", "<"))})
    if out.returncode != 0 or "criu" not in names:
        raise CriuUnavailable(f"no criu in Debian unstable's package lists: {out.stderr.strip()[-300:]}")
    return names


def _apt_options(cache: Path) -> list[str]:
    """apt-get options for a private apt setup: Debian unstable only, state and cache under `cache`."""
    uris = re.search(r"^URIs:\s*(\S+)", SYSTEM_SOURCES.read_text(), re.M) if SYSTEM_SOURCES.exists() else None
    if uris is None:
        raise CriuUnavailable(f"no Debian source in {SYSTEM_SOURCES} to take unstable's packages from")
    apt = cache / "apt"
    for folder in ("lists/partial", "cache/archives/partial"):
        (apt / folder).mkdir(parents=True, exist_ok=True)
    (apt / "status").touch()
    sources = apt / "unstable.sources"
    sources.write_text(
        f"Types: deb\nURIs: {uris[1]}\nSuites: {SUITE}\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    return [
        f"-oDir::Etc::sourcelist={sources}",
        "-oDir::Etc::sourceparts=-",
        f"-oDir::State::Lists={apt / 'lists'}",
        f"-oDir::Cache={apt / 'cache'}",
        f"-oDir::State::status={apt / 'status'}",
        "-oAPT::Architecture=amd64",
        "-oAPT::Sandbox::User=root",
        "-qq",
    ]


def _run(argv: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuUnavailable(f"{what} failed: {exc}") from exc
    if done.returncode != 0:
        raise CriuUnavailable(f"{what} failed: {(done.stderr or done.stdout).strip()[-500:]}")


if __name__ == "__main__":
    try:
        print(ensure())
    except CriuUnavailable as exc:
        sys.exit(str(exc))
