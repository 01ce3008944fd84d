"""A task environment's content digest: what decides its images, so a changed task is a new image.

Images are tagged by task (tb__<task>__client), and a tag says nothing of what it was built
from: a task whose Dockerfile changed would be served its old image. Each image termpool
builds is therefore labelled with the digest of everything its build reads, and an image whose
label differs from the task's digest now is built again (environments/lifecycle.py).

The digest covers every service the task's compose model builds: its build section (without
the context's absolute path, which differs between hosts, and without proxy arguments, which
are the host's), its Dockerfile, and the files of its build context that `docker build` sends
(.dockerignore honoured) with their paths, modes and contents. Not the task's name: two tasks
with one environment have one digest, whatever they are called.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from docker.utils.build import exclude_paths

CONTENT_LABEL = "termpool.content"  # on every image termpool builds: the digest it was built from
DIGEST_FORMAT = "termpool-env-1"  # changed when what the digest covers changes
PROXY_ARGS = frozenset({"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"})
IGNORE_FILE = ".dockerignore"

# path -> ((size, mtime_ns, mode), sha256 hex): a file is read again only when its stat changes.
_file_hashes: dict[str, tuple[tuple, str]] = {}


def environment_digest(compose: dict) -> str:
    """The digest of every build of a resolved compose model (hex sha256); "" when it builds nothing."""
    builds = {name: svc["build"] for name, svc in sorted(compose["services"].items()) if svc.get("build")}
    if not builds:
        return ""
    whole = hashlib.sha256(DIGEST_FORMAT.encode())
    for name, build in builds.items():
        whole.update(f"\0service {name}\0{build_digest(build)}".encode())
    return whole.hexdigest()


def build_digest(build: dict) -> str:
    """The digest of one compose build section: its settings, its Dockerfile, its context's files."""
    context = Path(build.get("context") or ".")
    dockerfile = str(build.get("dockerfile") or "Dockerfile")
    settings = {key: value for key, value in build.items() if key not in ("context", "dockerfile", "args")}
    args = {key: value for key, value in (build.get("args") or {}).items() if key not in PROXY_ARGS}
    one = hashlib.sha256()
    one.update(json.dumps({"settings": settings, "args": args, "dockerfile": dockerfile}, sort_keys=True).encode())
    one.update(b"\0dockerfile\0" + file_hash(context / dockerfile).encode())
    for name in context_files(context, dockerfile):
        path = context / name
        mode = os.lstat(path).st_mode
        content = os.readlink(path) if stat.S_ISLNK(mode) else file_hash(path)
        one.update(f"\0{name}\0{stat.S_IMODE(mode):o}\0{stat.S_IFMT(mode):o}\0{content}".encode())
    return one.hexdigest()


def context_files(context: Path, dockerfile: str) -> list[str]:
    """The files (and links) of a build context `docker build` would send, sorted, relative."""
    patterns = []
    ignore = context / IGNORE_FILE
    if ignore.is_file():
        lines = ignore.read_text(errors="replace").splitlines()
        patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    kept = exclude_paths(str(context), patterns, dockerfile=dockerfile)
    return sorted(name for name in kept if not (context / name).is_dir() or (context / name).is_symlink())


def file_hash(path: Path) -> str:
    """sha256 of a file's contents, remembered while its size, mtime and mode stay the same."""
    info = os.stat(path)
    signature = (info.st_size, info.st_mtime_ns, info.st_mode)
    known = _file_hashes.get(str(path))
    if known and known[0] == signature:
        return known[1]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    _file_hashes[str(path)] = (signature, digest.hexdigest())
    return digest.hexdigest()
