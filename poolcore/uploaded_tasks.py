"""Tasks sent by a client (POST /v1/tasks), named by the digest of their folder: what the
facade accepts, and how a worker host turns the stored archive back into a task folder
(docs/task-format.md, "Uploaded tasks"). Pure logic over files; the store is the caller's.

A run names one with task_meta.task_path = "sha256:<64 hex>". A dataset task path never looks
like that: any task_path starting "sha256:" is taken as a digest or refused.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from poolcore import task_archive
from poolcore.harbor_task import ENVIRONMENT_DIR, is_harbor_environment, is_harbor_task
from poolcore.paths import PathError
from poolcore.task_archive import ArchiveInvalid, Limits
from poolcore.task_spec import COMPOSE_FILE_NAMES, TaskError, load_task, one_per_host_reasons

PREFIX = "sha256:"
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def is_uploaded(task_path: str) -> bool:
    """A task_path that names an uploaded task (well formed or not)."""
    return isinstance(task_path, str) and task_path.startswith(PREFIX)


def checked_task_path(task_path: str) -> str:
    """The task_path as given when it is "sha256:" and 64 lowercase hex digits, else PathError."""
    if not _DIGEST.fullmatch(task_path):
        raise PathError(f"task_path {task_path[:80]!r} must be 'sha256:' and 64 lowercase hex digits (POST /v1/tasks)")
    return task_path


def hex_digest(task_path: str) -> str:
    return checked_task_path(task_path)[len(PREFIX) :]


def blob_id(task_path: str) -> str:
    """Where the store keeps its archive (Store.get_blob)."""
    return f"task:{hex_digest(task_path)}"


def facts_id(task_path: str) -> str:
    """Where the store keeps what placement needs of it (its one-per-host reasons, JSON)."""
    return f"task-facts:{hex_digest(task_path)}"


def folder_name(task_path: str) -> str:
    """Its folder's name on a worker host, which is also its task name for Docker (images
    tb__sha256-<hex>__client): a valid Docker name, the same for the same content everywhere."""
    return f"sha256-{hex_digest(task_path)}"


def docker_task_name(task_meta: dict) -> str:
    """The name a run's images and compose projects are derived from: the digest's for an
    uploaded task (two uploads may share a client's task_name), else task_meta.task_name."""
    path = task_meta.get("task_path") or ""
    return folder_name(path) if is_uploaded(path) else task_meta["task_name"]


# ---- what the facade accepts --------------------------------------------------------------------
@dataclass(frozen=True)
class Upload:
    task_path: str  # sha256:<hex>
    kind: str  # "terminal-bench", "harbor" or "harbor-environment"
    size: int  # bytes of the files, unpacked
    archive: bytes  # the canonical archive, as stored
    one_per_host: tuple[str, ...] = ()  # why two live runs of it cannot share a host (task_spec)


def accept(body: bytes, limits: Limits) -> Upload:
    """Read and check an uploaded archive: safe, within the limits, a task of either format
    (or a bare Harbor environment) that the readers take. ArchiveInvalid / ArchiveTooLarge."""
    entries = task_archive.read_archive(body, limits)
    with tempfile.TemporaryDirectory(prefix="termpool-upload-") as tmp:
        folder = Path(tmp) / "task"
        folder.mkdir()
        task_archive.write_folder(entries, folder)
        kind = check_task_folder(folder)
        reasons = one_per_host_reasons(folder)
    return Upload(
        task_path=PREFIX + task_archive.digest(entries),
        kind=kind,
        size=task_archive.unpacked_size(entries),
        archive=task_archive.canonical_archive(entries),
        one_per_host=reasons,
    )


def check_task_folder(folder: Path) -> str:
    """Its kind, when the folder is a task the pool can run; ArchiveInvalid says what is
    missing or what the readers refuse (paths shown relative to the folder)."""
    if (folder / "task.yaml").is_file():
        kind = "terminal-bench"
        if not any((folder / name).is_file() for name in ("Dockerfile", *COMPOSE_FILE_NAMES)):
            raise ArchiveInvalid("a terminal-bench task (task.yaml) needs a Dockerfile or a docker-compose.yaml")
    elif is_harbor_task(folder):
        kind = "harbor"
        if not (folder / ENVIRONMENT_DIR).is_dir():
            raise ArchiveInvalid("a Harbor task (task.toml + instruction.md) needs an environment/ folder")
    elif is_harbor_environment(folder):
        kind = "harbor-environment"
    else:
        raise ArchiveInvalid(f"not a task: {_missing(folder)}")
    try:
        load_task(folder)
    except TaskError as exc:
        raise ArchiveInvalid(str(exc).replace(f"{folder}/", "").replace(str(folder), "the folder")) from None
    return kind


def _missing(folder: Path) -> str:
    has = {name for name in ("task.yaml", "task.toml", "instruction.md") if (folder / name).is_file()}
    if "task.toml" in has:
        return "task.toml needs instruction.md (a Harbor task) or an environment/ folder (a bare Harbor environment)"
    found = ", ".join(sorted(p.name for p in folder.iterdir())[:10]) or "nothing"
    return (
        "no task.yaml (a terminal-bench task), no task.toml + instruction.md + environment/ (a Harbor task) and "
        f"no task.toml + environment/ (a bare Harbor environment) at the archive's top level; it holds: {found}"
    )


# ---- what a worker host does --------------------------------------------------------------------
def materialize(archive: bytes, folder: Path, limits: Limits, task_path: str) -> Path:
    """The uploaded task's folder, written from its stored archive unless present: checked as
    an upload is (and its digest compared), written beside `folder` and renamed into place, so
    a folder that exists is complete; a concurrent writer's folder wins."""
    if folder.is_dir():
        return folder
    entries = task_archive.read_archive(archive, limits)
    if PREFIX + task_archive.digest(entries) != task_path:
        raise ArchiveInvalid(f"the stored archive of {task_path} does not match its digest")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        task_archive.write_folder(entries, tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
