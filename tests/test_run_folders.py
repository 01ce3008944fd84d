"""Closed runs' folders are removed RUN_FOLDER_TTL after their teardown (tasks/run_folders.py,
the reconcile's step): the teardown notes each in the state store (a real redis-server), the
prune removes the folders past their time on disk (a run started on a warm spare: the spare's
folder too), and nothing outside the output root."""

from __future__ import annotations

import time
import uuid

import pytest

from environments import artifacts
from poolcore.config import load_settings
from poolcore.state import Store
from tasks import run_folders

pytestmark = pytest.mark.unit
TTL = 100.0


@pytest.fixture
def host(redis_server, tmp_path, monkeypatch):
    store = Store(redis_server)
    cfg = load_settings({"TBENCH_OUTPUT_ROOT": str(tmp_path / "out"), "RUN_FOLDER_TTL": str(TTL)})
    monkeypatch.setattr(run_folders, "store", lambda: store)
    monkeypatch.setattr(run_folders, "settings", lambda: cfg)
    return "h" + uuid.uuid4().hex[:8], store, cfg


def run_folder(cfg, run_id: str, mounts_from=None):
    path = artifacts.run_dir(str(cfg.default_log_dir), "hello-file", "0", run_id, mounts_from)
    (path / "tool_calls.jsonl").write_text("{}\n")
    return path


def test_folders_past_their_time_go_with_their_spare_folder_and_the_rest_stay(host, tmp_path):
    name, store, cfg = host
    spare = artifacts.run_dir(str(cfg.output_root / ".warm"), "pool", "0", "warm-1")
    (spare / "sessions" / "main.log").write_text("output\n")
    old, recent = run_folder(cfg, "run-old"), run_folder(cfg, "run-new")
    warm_served = run_folder(cfg, "run-warm", spare)
    outside = tmp_path / "elsewhere" / "run-x"
    outside.mkdir(parents=True)
    now = time.time()
    store.note_run_folder(name, str(old), now - TTL - 10)
    store.note_run_folder(name, str(warm_served), now - TTL - 5)
    store.note_run_folder(name, str(outside), now - TTL - 1)
    run_folders.note(name, str(recent))

    assert run_folders.prune(name) == [str(old), str(warm_served), str(outside)]
    assert not old.exists() and not warm_served.exists() and not spare.exists()
    assert recent.is_dir() and outside.is_dir()  # too young; not inside the output root
    assert store.run_folders_before(name, now + 1, 10) == [str(recent)]
    assert run_folders.prune(name) == []


def test_the_task_folder_goes_with_its_last_run(host):
    name, store, cfg = host
    path = run_folder(cfg, "run-only")
    store.note_run_folder(name, str(path), time.time() - TTL - 1)
    run_folders.prune(name)
    assert not path.parent.exists() and cfg.default_log_dir.is_dir()


def test_ttl_zero_keeps_every_folder(host, monkeypatch):
    name, store, cfg = host
    kept = load_settings({"TBENCH_OUTPUT_ROOT": str(cfg.output_root), "RUN_FOLDER_TTL": "0"})
    monkeypatch.setattr(run_folders, "settings", lambda: kept)
    path = run_folder(cfg, "run-kept")
    run_folders.note(name, str(path))
    store.note_run_folder(name, str(path), 0.0)
    assert run_folders.prune(name) == [] and path.is_dir()
