"""Find the task directories of a dataset and list what is wrong with each (`dataset check`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from poolcore import task_spec
from poolcore.config import Settings
from poolcore.failures import TaskInvalid, TaskUnsupported
from poolcore.harbor_task import is_harbor_task
from poolcore.task_spec import (
    COMPOSE_FILE_NAMES,
    NoGrader,
    TaskError,
    compose_file,
    image_name,
    load_task,
    name_prefix,
    one_per_host_reasons,
)

MAX_DEPTH = 3  # dataset/collection/sub-collection/task at most
CHECK_JOBS = 4  # tasks checked at once
CHECK_TIMEOUT = 60.0  # seconds for one `docker compose config`


def is_task_dir(path: Path) -> bool:
    return task_spec.is_task_dir(path)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def find_tasks(root: Path) -> list[Path]:
    """Task directories under root, sorted by path.

    root may be a task itself. Otherwise every visible subdirectory is a task, except one
    without task.yaml that holds task directories below it: a collection (e.g. the adapted
    benchmarks, dataset/<benchmark>/<task>), searched the same way. A subdirectory that is
    neither is listed as a task too, so `check` says what it lacks.
    """
    root = Path(root)
    if is_task_dir(root):
        return [root]
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        for sub in _subdirs(folder):
            if is_task_dir(sub):
                found.append(sub)
            elif depth < MAX_DEPTH and _holds_tasks(sub, depth + 1):
                walk(sub, depth + 1)
            else:
                found.append(sub)

    walk(root, 1)
    return found


def _holds_tasks(folder: Path, depth: int) -> bool:
    return any(is_task_dir(sub) or (depth < MAX_DEPTH and _holds_tasks(sub, depth + 1)) for sub in _subdirs(folder))


def task_label(task_dir: Path, root: Path) -> str:
    """The task's path relative to the dataset root (its name when root is the task)."""
    try:
        rel = task_dir.relative_to(root).as_posix()
    except ValueError:
        rel = ""
    return rel if rel and rel != "." else task_dir.name


@dataclass
class TaskReport:
    path: Path
    label: str
    problems: list[str] = field(default_factory=list)
    # Not problems: why the task allows one live run per host (TaskSpec.one_per_host)
    one_per_host: list[str] = field(default_factory=list)


def _strip(message: str, task_dir: Path) -> str:
    """TaskError messages start with the (long) task path: keep what follows it."""
    text = str(message)
    for prefix in (str(task_dir / "task.yaml") + ": ", str(task_dir) + ": ", str(task_dir.resolve()) + "/"):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def _compose_problems(task_dir: Path, cfg: Settings) -> list[str]:
    """What the start path would refuse: the same resolving and rules (environments/compose_config.py,
    imported here: the facade loads this CLI and must not load the Docker side)."""
    from environments import compose_config

    try:
        if not is_harbor_task(task_dir):  # a Harbor task's base compose file is termpool's
            compose_file(task_dir)
    except TaskError:
        return [f"no {' or '.join(COMPOSE_FILE_NAMES)}"]
    try:
        resolved = compose_config.resolve(
            task_dir,
            compose_config.task_files(task_dir, cfg),
            name_prefix(task_dir.name).lower(),
            compose_config.build_env(task_dir.name, cfg),
            CHECK_TIMEOUT,
        )
    except (TaskInvalid, TaskUnsupported, TaskError) as exc:
        return [_strip(exc, task_dir)]
    problems = compose_config.unsupported(resolved, task_dir) + compose_config.check_only_problems(resolved, task_dir)
    client = compose_config.client_problem(resolved, compose_config.BUILD_CLIENT_NAME)  # build_env's client name
    problems += [client] if client else []
    for name, service in resolved["services"].items():
        if "build" in service:
            problems += _build_problems(name, service["build"], task_dir)
    return problems


def _build_problems(service: str, build: dict, task_dir: Path) -> list[str]:
    context = build.get("context", "")
    if "://" in context or context.startswith("git@"):
        return []  # a remote context: nothing to check on disk
    context_dir = Path(context)
    shown = os.path.relpath(context_dir, task_dir)
    if not context_dir.is_dir():
        return [f"service {service!r}: build context {shown} is not a directory"]
    dockerfile = build.get("dockerfile")
    if dockerfile and "dockerfile_inline" not in build and not (context_dir / dockerfile).is_file():
        where = "" if shown == "." else f" in {shown}"
        return [f"service {service!r}: no {dockerfile}{where} (its build context)"]
    return []


def check_task(task_dir: Path, root: Path, cfg: Settings) -> TaskReport:
    report = TaskReport(task_dir, task_label(task_dir, root))
    problems = report.problems
    if not (task_dir / "task.yaml").is_file() and is_harbor_task(task_dir):
        try:
            load_task(task_dir)
        except TaskError as exc:
            problems.append(_strip(exc, task_dir))
            return report
        problems += _compose_problems(task_dir, cfg)
        report.one_per_host += one_per_host_reasons(task_dir)
        return report
    has_yaml = (task_dir / "task.yaml").is_file()
    has_grader = (task_dir / "run-tests.sh").is_file()
    if not has_yaml:
        problems.append("no task.yaml")
    else:
        try:
            load_task(task_dir)
        except NoGrader:
            pass  # reported below
        except TaskError as exc:
            problems.append(_strip(exc, task_dir))
    if not has_grader:
        problems.append("no run-tests.sh (the grader)")
    if not (task_dir / "tests").is_dir():
        problems.append("no tests/ folder")
    problems += _compose_problems(task_dir, cfg)
    report.one_per_host += one_per_host_reasons(task_dir)  # what placement reads: the raw file
    return report


def check_tasks(root: Path, tasks: list[Path], cfg: Settings, on_done=None) -> list[TaskReport]:
    """Reports in the order of tasks; several at once (each runs `docker compose config`)."""
    reports = []
    with ThreadPoolExecutor(max_workers=CHECK_JOBS, thread_name_prefix="check") as pool:
        for report in pool.map(lambda task_dir: check_task(task_dir, root, cfg), tasks):
            reports.append(report)
            if on_done:
                on_done(report.path)
    _image_collisions(reports)
    return reports


def _image_collisions(reports: list[TaskReport]) -> None:
    """Two task names that map to one image name would share (and overwrite) images."""
    owners: dict[str, list[TaskReport]] = {}
    for report in reports:
        try:
            owners.setdefault(image_name(report.path.name), []).append(report)
        except TaskError as exc:
            report.problems.append(str(exc))
    for image, same in owners.items():
        if len(same) > 1:
            for report in same:
                others = ", ".join(o.label for o in same if o is not report)
                report.problems.append(f"image name {image} is also that of {others}")
