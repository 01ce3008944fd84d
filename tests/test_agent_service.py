"""The agent's container is the service terminal-bench would use: the one whose container_name
is ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}, else the one named `client`; neither, or two,
is TASK_INVALID at /reset and in `dataset check`. termpool's additions go to that service,
whatever its name; every other service stays a sidecar.

Fixtures: compose-agent-service (sidecars `api` and `ledger`, the agent's `workstation`; the
compose path), compose-agent-alone (one service, `workstation`; the SDK fast path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from devstack import FIXTURES
from environments import compose_cache, compose_config, container_spec, lifecycle
from environments.compose_config import BUILD_CLIENT_NAME, CLIENT_NAME_VAR
from environments.session_helper import CTL_DIR
from poolcore.failures import TaskInvalid
from poolcore.state import Store
from tests.conftest import Router, private_stack
from tests.test_compose_fidelity import episode, settings
from tests.test_dataset_cli import cli

VAR = "${" + CLIENT_NAME_VAR + "}"
IMAGE = "${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}"
AGENT = f"""    build:
      dockerfile: Dockerfile
    image: {IMAGE}
    command: [ "sh", "-c", "sleep infinity" ]
"""
SIDECAR = f'    image: {IMAGE}\n    command: [ "sh", "-c", "sleep infinity" ]\n'
# Files with no single agent's service: (compose file, the words its error must hold).
NO_AGENT = {
    "agent-neither": (
        f"services:\n  dns:\n{SIDECAR}  box:\n{AGENT}    container_name: agent-box\n",
        ["none is named 'client'", "'box'", "'dns'", CLIENT_NAME_VAR],
    ),
    "agent-two": (
        f"services:\n  box:\n{AGENT}    container_name: {VAR}\n  spare:\n{SIDECAR}    container_name: {VAR}\n",
        ["'box'", "'spare'", CLIENT_NAME_VAR, "exactly one service"],
    ),
    "agent-alone-unnamed": (f"services:\n  box:\n{AGENT}", ["none is named 'client'", "'box'"]),
}


def model(**services) -> dict:
    return {"name": "p", "services": services}


# ---- the rule (no Docker) -------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize(
    "services, agent",
    [
        ({"client": {}, "db": {}}, "client"),  # the template
        ({"api": {}, "ws": {"container_name": "run-1"}}, "ws"),  # the real case: not first, not `client`
        ({"client": {}, "ws": {"container_name": "run-1"}}, "ws"),  # the container name wins
        ({"client": {"container_name": "fixed"}, "db": {}}, "client"),  # a fixed name: still `client`
        ({"client": {}, "db": {"container_name": "run-1-db"}}, "client"),  # the variable inside another name
    ],
)
def test_the_agents_service(services, agent):
    assert compose_config.client_service(model(**services), "run-1") == agent
    assert not compose_config.client_problem(model(**services), "run-1")


@pytest.mark.unit
@pytest.mark.parametrize(
    "services, words",
    [
        ({"api": {}, "box": {"container_name": "other"}}, ["none is named 'client'", "'api', 'box'", VAR]),
        (
            {"client": {}, "a": {"container_name": "run-1"}, "b": {"container_name": "run-1"}},
            ["'a', 'b'", VAR, "exactly one service"],
        ),
    ],
)
def test_no_single_agents_service_is_task_invalid(services, words):
    with pytest.raises(TaskInvalid) as err:
        compose_config.client_service(model(**services), "run-1")
    assert all(word in str(err.value) for word in words), str(err.value)
    assert compose_config.client_problem(model(**services), "run-1") == str(err.value)


@pytest.mark.unit
def test_the_fast_path_takes_one_agents_service_whatever_its_name(tmp_path):
    def alone(name: str, **svc) -> dict:
        return model(**{name: {"image": "img", "command": ["sleep", "infinity"], **svc}})

    assert container_spec.direct_eligible(alone("workstation", container_name="run-1"), tmp_path, "img", "run-1")
    assert container_spec.direct_eligible(alone("client"), tmp_path, "img", "run-1")
    assert not container_spec.direct_eligible(alone("workstation"), tmp_path, "img", "run-1")  # no agent: refused
    two = model(client={"image": "img"}, workstation={"image": "img", "container_name": "run-1"})
    assert not container_spec.direct_eligible(two, tmp_path, "img", "run-1")


def resolved_for_run(task: str, name: str, run_dir: Path, cfg) -> dict:
    task_dir = FIXTURES / task

    def make_env(project: str, folder: Path) -> dict:
        return compose_config.compose_env(task, project, folder, compose_config.client_image(task, cfg))

    return compose_cache.resolve_run(task_dir, compose_config.task_files(task_dir, cfg), name, run_dir, make_env, 60)


@pytest.mark.unit
def test_detected_on_every_resolution_the_pool_makes(tmp_path):
    """The build model (BUILD_CLIENT_NAME), a run's model resolved for real, and the next run's
    from the cached template (placeholders substituted) all name the same agent's service."""
    cfg = settings(tmp_path)
    compose_cache.clear()
    try:
        for task, fast in (("compose-agent-service", False), ("compose-agent-alone", True)):
            built = lifecycle.load_compose(task, FIXTURES / task, cfg, 60)
            assert compose_config.client_service(built, BUILD_CLIENT_NAME) == "workstation"
            assert lifecycle.is_template(built, cfg, FIXTURES / task, task) is fast
            for run in ("r1", "r2"):  # r1 resolved for real, r2 from the template
                name = f"{task}-{run}"
                resolved = resolved_for_run(task, name, tmp_path / run, cfg)
                assert compose_config.client_service(resolved, name) == "workstation"
                assert lifecycle.is_template(resolved, cfg, FIXTURES / task, task, name) is fast
    finally:
        compose_cache.clear()


@pytest.mark.unit
def test_additions_go_to_the_agents_service(tmp_path):
    cfg = settings(tmp_path)
    name = "compose-agent-service-r1"
    resolved = resolved_for_run("compose-agent-service", name, tmp_path, cfg)
    override = container_spec.run_override(
        resolved, "compose-agent-service", {"termpool.run": "r1"}, name, ["/x:/y:rw"], cfg, 2
    )["services"]
    agent = override["workstation"]
    assert agent["container_name"] == name and agent["init"] is True and agent["volumes"] == ["/x:/y:rw"]
    assert agent["mem_limit"] == str(1024**3) and agent["cpus"]
    for sidecar in ("api", "ledger"):
        assert set(override[sidecar]) == {"labels", "pids_limit"}, override[sidecar]


@pytest.mark.unit
def test_two_candidates_are_named_by_the_resolution(tmp_path):
    """compose itself refuses two services with one container_name, naming only one of them:
    termpool's message names both."""
    task_dir = shutil.copytree(FIXTURES / "hello-file", tmp_path / "agent-two")
    (task_dir / "docker-compose.yaml").write_text(NO_AGENT["agent-two"][0])
    with pytest.raises(TaskInvalid) as err:
        lifecycle.load_compose(task_dir.name, task_dir, settings(tmp_path), 60)
    assert all(word in str(err.value) for word in NO_AGENT["agent-two"][1]), str(err.value)
    assert BUILD_CLIENT_NAME not in str(err.value)


@pytest.mark.unit
def test_dataset_check_names_the_services(tmp_path):
    data = tmp_path / "ds"
    for task, (compose, _) in NO_AGENT.items():
        shutil.copytree(FIXTURES / "hello-file", data / task)
        (data / task / "docker-compose.yaml").write_text(compose)
    for task in ("compose-agent-service", "compose-agent-alone"):
        shutil.copytree(FIXTURES / task, data / task)
    result = cli(tmp_path)("check", data, "--json")
    assert result.exit_code == 1, result.output
    found: dict[str, list[str]] = {}
    for problem in json.loads(result.stdout)["problems"]:
        found.setdefault(problem["task"], []).append(problem["problem"])
    assert set(found) == set(NO_AGENT), found  # the two fixtures are clean
    for task, (_, words) in NO_AGENT.items():
        [problem] = found[task]
        assert all(word in problem for word in words), problem


# ---- through the pool API -------------------------------------------------------------------
@pytest.fixture(scope="module")
def agent_stack(base_image, docker_client, tmp_path_factory):
    dataset = tmp_path_factory.mktemp("agent-dataset")
    for task in ("compose-agent-service", "compose-agent-alone"):
        shutil.copytree(FIXTURES / task, dataset / task)
    for task, (compose, _) in NO_AGENT.items():
        shutil.copytree(FIXTURES / "hello-file", dataset / task)
        (dataset / task / "docker-compose.yaml").write_text(compose)
    yield from private_stack(docker_client, {"DATASET_DIR": str(dataset)})


def agent_episode(router: Router, docker_client, task: str, checks) -> None:
    """A whole episode (test_compose_fidelity.episode: reset, the checks, the solution,
    evaluate = 1.0, close, nothing left); the checks get the run's env and its containers by
    name, and a tool call runs in the agent's machine."""

    def with_env(lease, _):
        env = Store(router.stack.redis).get_run(lease)["env"]
        checks(lease, env, {c.name: c for c in router.run_containers(docker_client, lease)})
        assert router.sh(lease, "cat /etc/termpool-fixture/role").strip() == "workstation"

    episode(router, docker_client, task, with_env)


def mounts_ctl(container) -> bool:
    return any(m["Destination"] == CTL_DIR for m in container.attrs["Mounts"])


def test_episode_agent_not_named_client(agent_stack, docker_client):
    router = Router(agent_stack)

    def checks(lease, env, containers):
        assert env["mode"] == "compose"
        agent = containers.pop(env["client"])
        assert agent.labels["com.docker.compose.service"] == "workstation"
        assert agent.attrs["HostConfig"]["Init"] is True and agent.attrs["HostConfig"]["Memory"] == 1024**3
        assert mounts_ctl(agent) and agent.labels["termpool.run"] == lease
        services = {c.labels["com.docker.compose.service"]: c for c in containers.values()}
        assert set(services) == {"api", "ledger"}
        for sidecar in services.values():  # labelled, pids-limited, nothing else of termpool's
            host = sidecar.attrs["HostConfig"]
            assert not host.get("Init") and not host["Memory"] and not mounts_ctl(sidecar)
            assert sidecar.labels["termpool.run"] == lease and sidecar.name != env["client"]
        out = router.sh(lease, "cat /etc/hostname; ls /etc/termpool-fixture")
        assert out.split() == [agent.attrs["Config"]["Hostname"], "role"]

    agent_episode(router, docker_client, "compose-agent-service", checks)


def test_episode_one_service_not_named_client_on_the_fast_path(agent_stack, docker_client):
    def checks(lease, env, containers):
        assert env["mode"] == "direct" and list(containers) == [env["client"]]
        agent = containers[env["client"]]
        assert "com.docker.compose.project" not in agent.labels and mounts_ctl(agent)

    agent_episode(Router(agent_stack), docker_client, "compose-agent-alone", checks)


@pytest.mark.parametrize("task", sorted(NO_AGENT))
def test_reset_without_one_agents_service_is_task_invalid(agent_stack, docker_client, task):
    router = Router(agent_stack)
    lease = router.allocate(task)
    try:
        reply = router.reset(lease, task)
        body = reply.json()
        assert reply.status_code == 500 and body["code"] == "TASK_INVALID", reply.text
        assert all(word in body["error"] for word in NO_AGENT[task][1]), body["error"]
        project = lifecycle.run_name(task, lease)
        assert not router.run_containers(docker_client, lease)
        for label in (f"termpool.run={lease}", f"com.docker.compose.project={project}"):
            assert not docker_client.containers.list(all=True, filters={"label": label})
            assert not docker_client.networks.list(filters={"label": label})
            assert not docker_client.volumes.list(filters={"label": label})
    finally:
        router.close(lease)
