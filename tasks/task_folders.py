"""Where a run's task folder is on this worker host: under DATASET_DIR, or for an uploaded task
(task_path "sha256:<hex>") written out from its stored archive into UPLOADED_TASKS_DIR the
first time a run of it reaches this host (poolcore/uploaded_tasks.py). From there on it is
built and run as a dataset task is."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from environments import task_images
from environments.compose_config import client_image
from poolcore import failures, uploaded_tasks
from poolcore.config import Settings, settings
from poolcore.paths import resolve_task_path
from poolcore.task_archive import ArchiveInvalid
from tasks.runtime import store


def task_dir(task_path: str, cfg: Settings | None = None) -> Path:
    cfg = cfg or settings()
    if not uploaded_tasks.is_uploaded(task_path):
        return resolve_task_path(cfg.dataset_dir, task_path)
    folder = cfg.uploaded_tasks_dir / uploaded_tasks.folder_name(task_path)
    if folder.is_dir():
        return folder
    archive = store().get_blob(uploaded_tasks.blob_id(task_path))
    if archive is None:
        raise failures.UnknownTask(f"the uploaded task {task_path} has expired (UPLOADED_TASK_TTL): upload it again")
    try:
        return uploaded_tasks.materialize(archive, folder, cfg.uploaded_task_limits, task_path)
    except ArchiveInvalid as exc:  # the facade took it, so only a change of the limits or the store
        raise failures.TaskInvalid(f"the uploaded task {task_path} cannot be written out here: {exc}") from None


def remove_expired(live_task_paths: set[str]) -> list[str]:
    """Remove this host's written-out uploaded tasks whose archive has expired and that no live
    run names (the reconcile); their names. A run of one again would find it gone from the
    store too, so nothing could rebuild it anyway."""
    root = settings().uploaded_tasks_dir
    removed = []
    for folder in sorted(root.glob("sha256-*")) if root.is_dir() else []:
        task_path = uploaded_tasks.PREFIX + folder.name.removeprefix("sha256-")
        if task_path in live_task_paths or not _well_formed(task_path):
            continue
        if store().blob_size(uploaded_tasks.blob_id(task_path)) is None:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def remove_expired_images(host: str, live_task_paths: set[str]) -> list[str]:
    """Remove this host's images of uploaded tasks whose archive has expired and that no live
    run names (the reconcile), and forget they were built; their task paths. Each upload of new
    content is a new image, so without this a host running generated tasks grows by an image
    per task. A run of one uploaded again finds its image gone and builds it again."""
    cfg = settings()
    removed = []
    for task_path in sorted(store().ready_images(host)):
        if not uploaded_tasks.is_uploaded(task_path) or task_path in live_task_paths:
            continue
        if not _well_formed(task_path) or store().blob_size(uploaded_tasks.blob_id(task_path)) is not None:
            continue
        image = client_image(uploaded_tasks.folder_name(task_path), cfg)
        if task_images.remove_built(host, image, functools.partial(store().build_lock, host)):
            store().mark_image_ready(host, task_path, False)
            removed.append(task_path)
    return removed


def _well_formed(task_path: str) -> bool:
    try:
        uploaded_tasks.checked_task_path(task_path)
    except ValueError:
        return False
    return True
