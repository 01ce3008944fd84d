"""Per-run artifacts under the run's log dir (docs/task-format.md, "Per-run artifacts")."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from environments.tools import cap_text
from poolcore.config import settings

TOOL_LOG = "tool_calls.jsonl"
TEST_LOG = "tests.log"
RESULTS = "results.json"


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", part).strip(".") or "_"


MOUNTED = ("sessions", "agent-logs")


def run_dir(log_dir: str, task_name: str, uid: str, run_id: str, mounts_from: Path | None = None) -> Path:
    """<log_dir>/<task_name>/<task_name>.<uid>.<run_id>, with the two mounted folders.

    A run on a warm-pool container links them to the folders that container was started with.
    """
    task = _safe(task_name)
    path = Path(log_dir) / task / f"{task}.{_safe(uid)}.{run_id}"
    path.mkdir(parents=True, exist_ok=True)
    for sub in MOUNTED:
        if mounts_from is not None:
            if not (path / sub).exists():
                (path / sub).symlink_to(mounts_from / sub)
            continue
        (path / sub).mkdir(exist_ok=True)
        # The task's container user may be anyone; these are its log mounts.
        os.chmod(path / sub, 0o777)
    return path


def _capped(value, limit: int):
    """value with every string in it cut to its newest `limit` characters (a note says so)."""
    if isinstance(value, str):
        return cap_text(value, limit)
    if isinstance(value, dict):
        return {key: _capped(item, limit) for key, item in value.items()}
    if isinstance(value, list):
        return [_capped(item, limit) for item in value]
    return value


def log_tool_call(path: Path, tool_call: dict, observation: str, seconds: float, limit: int | None = None) -> None:
    """Append one record; each string in it (a model's file content, an observation) is cut
    to `limit` characters (default OBSERVATION_LIMIT), so one call writes a bounded record."""
    limit = settings().observation_limit if limit is None else limit
    record = {
        "time": time.time(),
        "tool_call": _capped(tool_call, limit),
        "observation": cap_text(observation, limit),
        "seconds": round(seconds, 4),
    }
    with open(path / TOOL_LOG, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_test_output(path: Path, output: str) -> None:
    (path / TEST_LOG).write_text(output, encoding="utf-8")


def write_results(path: Path, results: dict) -> None:
    tmp = path / (RESULTS + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False), encoding="utf-8")
    tmp.replace(path / RESULTS)


def remove_run_folder(path: Path, root: Path) -> None:
    """Remove a closed run's folder, the spare's folder its mounts link to (a run started on a
    warm spare) and its task folder once empty; only what lies inside `root`, the output root."""
    root = root.resolve()
    for sub in MOUNTED:
        link = path / sub
        if link.is_symlink():  # <spare folder>/<sub>: the spare's folder goes with the run
            _remove_inside(Path(os.readlink(link)).parent, root)
    _remove_inside(path, root)
    try:
        path.parent.rmdir()  # <log_dir>/<task>: kept while another run of the task has its folder
    except OSError:
        pass


def _remove_inside(path: Path, root: Path) -> None:
    resolved = path.resolve()
    if resolved != root and resolved.is_relative_to(root):
        shutil.rmtree(resolved, ignore_errors=True)
