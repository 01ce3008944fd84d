"""`dataset download`: fetch one dataset's folder with a shallow, sparse git clone.

Each known dataset is a folder of a public git repository. Only that folder is checked out:
`git clone --filter=blob:none --sparse --depth 1`, then `git sparse-checkout set <folder>`,
so the download is the folder's files and not the repository's history or other folders.
The result goes to <dest>/<dataset name>/ (one directory per task, or per benchmark for
collections), with a .termpool-source.json saying where and at which commit it came from.

The origins below are defaults; each part can be changed per dataset by the settings
(TERMPOOL_DATASET_<NAME>_ORIGIN, _REF, _SUBDIR; e.g. TERMPOOL_DATASET_TBENCH_CORE_ORIGIN) or
by the command's options, for mirrors and machines without internet access.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from poolcore.task_spec import is_task_dir

ROOT = "."  # a subdir candidate: the repository's top level (Harbor datasets keep their tasks there)


@dataclass(frozen=True)
class DatasetSource:
    name: str
    origin: str
    ref: str  # branch or tag; "" for the origin's default branch
    subdirs: tuple[str, ...]  # candidate folders, first existing one wins (repos get reorganised)
    flatten: bool = False  # <subdir>/<collection>/<task> -> <name>/<collection>_<task>
    description: str = ""


DATASETS: dict[str, DatasetSource] = {
    source.name: source
    for source in (
        DatasetSource(
            "seta_env",
            "https://github.com/camel-ai/seta-env.git",
            "main",
            ("Dataset",),
            description="SETA synthetic terminal tasks (seta-env)",
        ),
        DatasetSource(
            "tbench_core",
            "https://github.com/laude-institute/terminal-bench.git",
            "main",
            ("original-tasks", "tasks"),
            description="terminal-bench core tasks, main branch",
        ),
        DatasetSource(
            "tbench_test",
            "https://github.com/laude-institute/terminal-bench.git",
            "dataset/terminal-bench-core/v0.1.x",
            ("tasks",),
            description="terminal-bench-core v0.1.x, the released test set",
        ),
        DatasetSource(
            "tbench2",
            "https://github.com/laude-institute/terminal-bench-2.git",
            "main",
            ("tasks", ROOT),
            description="Terminal-Bench 2.0 in Harbor's format (task.toml, instruction.md), tasks at the top level",
        ),
        DatasetSource(
            "tbench_adapted",
            "https://github.com/laude-institute/terminal-bench-datasets.git",
            "main",
            ("datasets",),
            flatten=True,
            description="benchmarks adapted to the terminal-bench format, one folder per benchmark",
        ),
    )
}

SOURCE_FILE = ".termpool-source.json"


class DownloadError(RuntimeError):
    pass


def resolve_source(
    name: str,
    origin: str | None = None,
    ref: str | None = None,
    subdir: str | None = None,
    overrides: dict | None = None,
) -> DatasetSource:
    """The dataset's source after the settings' overrides (Settings.dataset_sources[name]:
    origin, ref, subdir) and the command's options (options win)."""
    source = DATASETS[name]
    overrides = overrides or {}
    origin = origin or overrides.get("origin") or source.origin
    ref = ref if ref is not None else overrides.get("ref", source.ref)
    subdir = subdir or overrides.get("subdir", "")
    subdirs = tuple(s.strip().strip("/") for s in subdir.split(",") if s.strip()) if subdir else source.subdirs
    return replace(source, origin=_as_url(origin), ref=ref, subdirs=subdirs)


def _as_url(origin: str) -> str:
    """A local repository path becomes a file:// URL, so git honours --depth and --filter."""
    if "://" not in origin and not origin.startswith("git@") and Path(origin).expanduser().is_dir():
        return Path(origin).expanduser().resolve().as_uri()
    return origin


def _git(args: list[str], cwd: Path | None = None, timeout: float = 3600) -> str:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_LFS_SKIP_SMUDGE": "1"}
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise DownloadError("git is not installed") from None
    except subprocess.TimeoutExpired:
        raise DownloadError(f"git {args[0]} did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise DownloadError(f"git {args[0]} failed: {tail}")
    return proc.stdout


def _task_folders(repo: Path) -> list[Path]:
    """The top-level folders of a repository that are tasks (of either format) or hold tasks
    one level down (collections); the rest (docs, scripts, CI) is left behind."""
    folders = sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [p for p in folders if is_task_dir(p) or any(is_task_dir(sub) for sub in p.iterdir() if sub.is_dir())]


# The steps of a download, each one call; the CLI shows them as a progress bar.
STEPS = ("clone", "checkout", "install")


class Download:
    """One dataset download: step() through the STEPS in order, then cleanup()."""

    def __init__(self, source: DatasetSource, dest: Path, force: bool = False):
        self.source = source
        self.dest = Path(dest)
        self.target = self.dest / source.name
        self.force = force
        self.work: Path | None = None
        self.found_subdir = ""
        self.commit = ""
        self.tasks = 0

    def exists(self) -> bool:
        return self.target.exists() and any(self.target.iterdir())

    def step(self, name: str) -> None:
        getattr(self, "_" + name)()

    def cleanup(self) -> None:
        if self.work and self.work.exists():
            shutil.rmtree(self.work, ignore_errors=True)

    def _clone(self) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        # Beside the target, so the final move is a rename on the same file system.
        self.work = Path(tempfile.mkdtemp(prefix=f".{self.source.name}-download-", dir=self.dest))
        args = ["clone", "--filter=blob:none", "--sparse", "--depth", "1", "--no-tags"]
        if self.source.ref:
            args += ["--branch", self.source.ref]
        _git(args + [self.source.origin, str(self.work / "repo")])

    def _checkout(self) -> None:
        repo = self.work / "repo"
        _git(["sparse-checkout", "set", *(s for s in self.source.subdirs if s != ROOT)], cwd=repo)
        self.commit = _git(["rev-parse", "HEAD"], cwd=repo).strip()
        for subdir in self.source.subdirs:
            if subdir == ROOT:  # the whole tree; _install keeps only its task folders
                _git(["sparse-checkout", "disable"], cwd=repo)
                self.found_subdir = subdir
                return
            if (repo / subdir).is_dir():
                self.found_subdir = subdir
                return
        ref = self.source.ref or "its default branch"
        raise DownloadError(f"{self.source.origin} ({ref}) has no folder {' or '.join(self.source.subdirs)}")

    def _install(self) -> None:
        folder = self.work / "repo" / self.found_subdir
        staged = self.work / "staged"
        if self.found_subdir == ROOT:
            staged.mkdir()
            for task in _task_folders(folder):
                task.rename(staged / task.name)
        elif self.source.flatten:
            staged.mkdir()
            for collection in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
                for task in sorted(p for p in collection.iterdir() if p.is_dir() and not p.name.startswith(".")):
                    task.rename(staged / f"{collection.name}_{task.name}")
        else:
            folder.rename(staged)
        self.tasks = sum(1 for p in staged.iterdir() if p.is_dir() and not p.name.startswith("."))
        (staged / SOURCE_FILE).write_text(
            json.dumps(
                {
                    "dataset": self.source.name,
                    "origin": self.source.origin,
                    "ref": self.source.ref,
                    "subdir": self.found_subdir,
                    "commit": self.commit,
                    "flattened": self.source.flatten,
                    "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                indent=2,
            )
            + "\n"
        )
        if self.target.exists():
            if not self.force and any(self.target.iterdir()):
                raise DownloadError(f"{self.target} already exists (use --force to replace it)")
            old = self.work / "old"
            self.target.rename(old)
        staged.rename(self.target)
