"""Compose resolution once per task, not once per start.

`docker compose config` (environments/compose_config.resolve) is a subprocess that costs tens of
milliseconds of CPU when idle and far more under load, and every start needs the resolved model.
Only two inputs of a start's model differ between runs: the run's name (compose project and
client container name) and its run folder (the log mounts). So a task is resolved once with
placeholder values for those two, and each run's model is that template with the placeholders
replaced by the run's own values.

That substitution is exact only when compose treats the two values as opaque text. It is
checked, not assumed: the first start of a task resolves both the real model and the template
(in parallel) and keeps the template only when substituting the real values into it gives the
real model exactly; otherwise that task is always resolved for real. A run name or folder
outside the placeholders' character set (a log folder with a space, say) is resolved for real
too.

Cached entries are keyed by every input of the resolution (files, project, variables) and
dropped when the compose files or any file directly in the task folder (`.env`, env_files)
change, and after MAX_AGE in any case (a file compose reads from elsewhere).
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from environments.compose_config import resolve

MAX_AGE = 600.0  # seconds an entry is trusted without a change to the files it watches
MAX_ENTRIES = 512
RUN_NAME_FORM = re.compile(r"[a-z0-9][a-z0-9_-]*")  # compose's own rule for project names
RUN_DIR_FORM = re.compile(r"(/[A-Za-z0-9_.-]+)+")

# Per process, so no task file can name them: lowercase hex in the forms a run name and a
# run folder have.
PLACEHOLDER_NAME = "tpname" + secrets.token_hex(8)
PLACEHOLDER_DIR = "/tpdir" + secrets.token_hex(8)

_NOT_SUBSTITUTABLE = object()
_lock = threading.Lock()
_entries: OrderedDict[tuple, tuple[tuple, float, object]] = OrderedDict()  # key -> (signature, time, value)


def files_signature(task_dir: Path, files: list[str]) -> tuple:
    """What the cached model depends on that can change on disk: the `-f` files and every
    file directly in the task folder, by (path, mtime, size, inode)."""
    paths = [files[i + 1] for i in range(0, len(files) - 1, 2) if files[i] == "-f"]
    try:
        paths += sorted(entry.path for entry in os.scandir(task_dir) if entry.is_file())
    except OSError:
        pass
    return tuple((path, *_stat(path)) for path in paths)


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return (None,)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _get(key: tuple, signature: tuple):
    with _lock:
        entry = _entries.get(key)
        if entry is None or entry[0] != signature or time.monotonic() - entry[1] > MAX_AGE:
            return None
        _entries.move_to_end(key)
        return entry[2]


def _put(key: tuple, signature: tuple, value) -> None:
    with _lock:
        _entries[key] = (signature, time.monotonic(), value)
        _entries.move_to_end(key)
        while len(_entries) > MAX_ENTRIES:
            _entries.popitem(last=False)


def clear() -> None:
    with _lock:
        _entries.clear()


def substitute(value, replacements: dict[str, str]):
    """A copy of a JSON value with every occurrence of each key replaced, in strings and keys."""
    if isinstance(value, str):
        for old, new in replacements.items():
            value = value.replace(old, new)
        return value
    if isinstance(value, dict):
        return {substitute(k, replacements): substitute(v, replacements) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, replacements) for v in value]
    return value


def substitutable(name: str, run_dir: str) -> bool:
    """Whether a run's values have the placeholders' form: a clean absolute path, plain characters."""
    return bool(
        RUN_NAME_FORM.fullmatch(name) and RUN_DIR_FORM.fullmatch(run_dir) and os.path.normpath(run_dir) == run_dir
    )


def resolve_once(task_dir: Path, files: list[str], project: str, env: dict, timeout: float) -> dict:
    """compose_config.resolve, remembered until the files it watches change (a copy each call)."""
    key = ("exact", str(task_dir), tuple(files), project, tuple(sorted(env.items())))
    signature = files_signature(task_dir, files)
    cached = _get(key, signature)
    if cached is None:
        cached = resolve(task_dir, files, project, env, timeout)
        _put(key, signature, cached)
    return substitute(cached, {})


def resolve_run(
    task_dir: Path,
    files: list[str],
    name: str,
    run_dir: Path,
    make_env: Callable[[str, Path], dict],
    timeout: float,
) -> dict:
    """The model `resolve(task_dir, files, name, make_env(name, run_dir))` gives, from the
    task's template when it has a checked one (see the module's docstring)."""
    real = {PLACEHOLDER_NAME: name, PLACEHOLDER_DIR: str(run_dir)}
    env = make_env(name, run_dir)
    if not substitutable(name, str(run_dir)):
        return resolve(task_dir, files, name, env, timeout)
    template_env = make_env(PLACEHOLDER_NAME, Path(PLACEHOLDER_DIR))
    key = ("run", str(task_dir), tuple(files), tuple(sorted(template_env.items())))
    signature = files_signature(task_dir, files)
    template = _get(key, signature)
    if template is _NOT_SUBSTITUTABLE:
        return resolve(task_dir, files, name, env, timeout)
    if template is not None:
        return substitute(template, real)
    pending = _Background(resolve, task_dir, files, PLACEHOLDER_NAME, template_env, timeout)
    resolved = resolve(task_dir, files, name, env, timeout)
    template = pending.result(default=_NOT_SUBSTITUTABLE)
    if template is not _NOT_SUBSTITUTABLE and substitute(template, real) != resolved:
        template = _NOT_SUBSTITUTABLE
    _put(key, signature, template)
    return resolved


class _Background:
    """fn(*args) in a thread of its own (no pool: a worker process may fork after import)."""

    def __init__(self, fn, *args):
        self._value, self._ok = None, False
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self._value, self._ok = fn(*args), True
        except Exception:  # the caller falls back to resolving for real
            pass

    def result(self, default):
        self._thread.join()
        return self._value if self._ok else default
