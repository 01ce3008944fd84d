"""Keep request-supplied paths inside their roots (docs/http-api.md section 3).

Pure logic over the file system's current state: a path is accepted only if, after every
symlink is followed and every ``..`` applied, it is the root or lies below it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class PathError(ValueError):
    """A request path is malformed or points outside the folder it must stay in."""


def _real(path: str) -> str:
    """Resolve symlinks and ``..``; parts that do not exist yet are taken as written.

    ``os.path.realpath`` follows every symlink of the deepest existing ancestor (dangling
    links included) and applies the rest lexically, which is what a path we may create
    later needs.
    """
    resolved = os.path.realpath(path)
    try:
        os.stat(resolved)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PathError(f"symlink loop in {path!r}") from None
    return resolved


def resolve_inside(
    root: Path | str,
    candidate: str,
    *,
    allow_absolute: bool,
    allow_root: bool = True,
    what: str = "path",
) -> Path:
    """Return ``candidate`` resolved against ``root`` if it stays inside ``root``.

    ``candidate`` is relative to ``root``; with ``allow_absolute`` an absolute path is
    accepted too, as long as it resolves inside ``root``. Raises PathError for a value that
    is not a string, empty, contains a NUL byte, is absolute when that is not allowed,
    escapes ``root`` (``..``, an absolute path elsewhere, a symlink out), or is ``root``
    itself when ``allow_root`` is false. ``what`` names the field in error messages.
    """
    if not isinstance(candidate, str):
        raise PathError(f"{what} must be a string, not {type(candidate).__name__}")
    if not candidate.strip():
        raise PathError(f"{what} must not be empty")
    if "\x00" in candidate:
        raise PathError(f"{what} must not contain a NUL byte")
    root_real = Path(_real(os.path.abspath(os.fspath(root))))
    if os.path.isabs(candidate):
        if not allow_absolute:
            raise PathError(f"{what} must be relative to {root_real}, not absolute: {candidate!r}")
        joined = candidate
    else:
        joined = os.path.join(root_real, candidate)
    resolved = Path(_real(joined))
    if resolved == root_real:
        if not allow_root:
            raise PathError(f"{what} {candidate!r} names {root_real} itself, not something inside it")
        return resolved
    try:
        resolved.relative_to(root_real)
    except ValueError:
        raise PathError(f"{what} {candidate!r} resolves to {resolved}, which is outside {root_real}") from None
    return resolved


def resolve_task_path(dataset_dir: Path | str, task_path: str) -> Path:
    """A task folder named by ``task_meta.task_path``: relative to DATASET_DIR (an absolute
    path inside it is accepted), never DATASET_DIR itself."""
    return resolve_inside(dataset_dir, task_path, allow_absolute=True, allow_root=False, what="task_path")


def resolve_log_dir(output_root: Path | str, log_dir: str) -> Path:
    """``run_ctx.log_dir``: absolute or relative to TBENCH_OUTPUT_ROOT, and inside it. It
    need not exist yet."""
    return resolve_inside(output_root, log_dir, allow_absolute=True, allow_root=True, what="log_dir")
