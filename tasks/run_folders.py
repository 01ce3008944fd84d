"""Closed runs' folders under the output root, removed RUN_FOLDER_TTL after their teardown (the
reconcile): the teardown notes each in the state store, so no sweep walks the output root."""

from __future__ import annotations

import time
from pathlib import Path

from environments import artifacts
from poolcore.config import settings
from tasks.runtime import store

PRUNE_BATCH = 2000  # folders removed per reconcile at most: a backlog goes over several sweeps


def note(host: str, run_dir: str) -> None:
    """A run's teardown: its folder's time starts (nothing when it never had one)."""
    if run_dir and settings().run_folder_ttl > 0:
        store().note_run_folder(host, run_dir)


def prune(host: str) -> list[str]:
    """Remove the folders of runs torn down more than RUN_FOLDER_TTL ago; their paths."""
    cfg = settings()
    if cfg.run_folder_ttl <= 0:
        return []
    paths = store().run_folders_before(host, time.time() - cfg.run_folder_ttl, PRUNE_BATCH)
    for path in paths:
        artifacts.remove_run_folder(Path(path), cfg.output_root)
    store().forget_run_folders(host, paths)
    return paths
