"""Compose fidelity: termpool's additions merge with what a task's compose file sets, both start
paths give the same container, and broken or refused files fail with their own error class.

Fixtures: compose-limits (deploy.resources limits + reservations, pids, shm_size, ulimits,
tmpfs), compose-healthy-sidecar (healthcheck + depends_on service_healthy, a custom network,
a build context in a subfolder, a sidecar image named from T_BENCH_TASK_DOCKER_NAME_PREFIX,
service-level mem_limit / cpus), compose-env (${VAR:-default}, ${VAR:?message}, env_file,
working_dir, entrypoint, user; on the SDK fast path).
"""

from __future__ import annotations

import functools
import json
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from devstack import FIXTURES, at_once
from environments import compose_config, container_spec, lifecycle, networks, task_builds
from environments.docker_client import ComposeError, run_compose
from poolcore.config import load_settings
from poolcore.failures import TaskBuildFailed, TaskInvalid, TaskStartFailed, TaskUnsupported
from poolcore.state import Store
from tests.conftest import wait_for
from tests.test_unsafe_tasks import CLIENT  # the template's client service, no volumes

GIB = 1024**3
FAST_PATH = {
    "hello-file",
    "partial-pass",
    "slow-tests",
    "interactive-guess",
    "broken-dockerfile",
    "compose-env",
    "slow-build",
    "compose-agent-alone",  # one service, the agent's, not named `client`
    "nginx-sshd-services",
    "fifo-repl",
    "tmux-detached",
}


def settings(tmp: Path, **env):
    return load_settings(
        {
            "POOL_HOST_ID": "t" + uuid.uuid4().hex[:8],
            "CONTAINER_MEMORY_LIMIT": "1g",
            "POOL_SOCKET_DIR": str(tmp / "sock"),
            "TBENCH_OUTPUT_ROOT": str(tmp / "out"),
            "REGISTRY_URL": "off",  # builds of this host alone (tests/test_pool_builds.py: the pool's)
            **env,
        }
    )


# ---- pure merging (no Docker) ---------------------------------------------------------------
@pytest.mark.unit
def test_limits_go_where_the_task_put_its_own(tmp_path):
    cfg = settings(tmp_path, CONTAINER_PIDS_LIMIT="100", CONTAINER_CPU_LIMIT="2")
    deploy = {
        "deploy": {
            "resources": {
                "limits": {"cpus": 1, "memory": str(4 * GIB), "pids": 500},
                "reservations": {"memory": str(2 * GIB)},
            }
        }
    }
    assert container_spec.limits(deploy, cfg, True, 8) == {
        "memswap_limit": str(GIB),
        "deploy": {
            "resources": {
                "limits": {"pids": 100, "memory": str(GIB)},  # pool's lower values win
                "reservations": {"memory": str(GIB)},
            }
        },
    }  # capped: it may not exceed the limit
    own = {"mem_limit": str(GIB // 2), "cpus": 0.5, "pids_limit": 50}
    assert container_spec.limits(own, cfg, True, 8) == {
        "memswap_limit": str(GIB // 2),
        "mem_limit": str(GIB // 2),
        "pids_limit": 50,
    }  # task's lower ones win
    assert container_spec.limits({}, cfg, True, 1) == {
        "memswap_limit": str(GIB),
        "mem_limit": str(GIB),
        "pids_limit": 100,
        "cpus": 1,
    }  # clamped to the host
    assert container_spec.limits({}, cfg, False, 8) == {"pids_limit": 100}  # memory and cpus: client only
    off = settings(tmp_path, CONTAINER_PIDS_LIMIT="0", CONTAINER_CPU_LIMIT="0", CONTAINER_MEMORY_LIMIT="0")
    assert container_spec.limits({}, off, True, 8) == {}


@pytest.mark.unit
def test_override_merges_with_deploy_limits(tmp_path):
    """The reported bug: a task with deploy.resources.limits made compose refuse termpool's
    override ("can't set distinct values on 'mem_limit' and 'deploy.resources.limits.memory'")."""
    cfg = settings(tmp_path)
    task_dir = FIXTURES / "compose-limits"
    env = compose_config.compose_env("compose-limits", "cl-x", tmp_path, "tb__compose-limits__client")
    files = compose_config.task_files(task_dir, cfg)
    resolved = compose_config.resolve(task_dir, files, "cl-x", env, 60)
    override = container_spec.run_override(
        resolved, "compose-limits", {"termpool.run": "x"}, "cl-x", ["/tmp/ctl:/.termpool/ctl:rw"], cfg, 2
    )
    (tmp_path / "o.yaml").write_text(yaml.safe_dump(override))
    merged = compose_config.resolve(task_dir, files + ["-f", str(tmp_path / "o.yaml")], "cl-x", env, 60)
    client = merged["services"]["client"]
    assert client["deploy"]["resources"]["limits"] == {"cpus": 1, "memory": str(512 * 1024**2), "pids": 128}
    assert client["memswap_limit"] == str(512 * 1024**2) and client["init"] is True
    assert client["labels"] == {"termpool.run": "x"} and client["container_name"] == "cl-x"


@pytest.mark.unit
def test_compose_errors_name_the_files(tmp_path):
    (tmp_path / "bad.yaml").write_text("services:\n  c:\n    image: [x\n")
    with pytest.raises(ComposeError) as err:
        run_compose(["-p", "x", "-f", str(tmp_path / "bad.yaml"), "config"], {}, 60, tmp_path)
    assert f"-f {tmp_path / 'bad.yaml'} config failed" in str(err.value)


# ---- errors by class ------------------------------------------------------------------------
def task_copy(tmp_path: Path, compose: str, name: str = "t-task", base: str = "hello-file") -> Path:
    task_dir = shutil.copytree(FIXTURES / base, tmp_path / name)
    (task_dir / "docker-compose.yaml").write_text(compose)
    return task_dir


def start(task_dir: Path, cfg, tmp_path: Path, force_compose=False):
    run = {"run_id": "r" + uuid.uuid4().hex[:10], "task_key": task_dir.name, "task_meta": {"task_name": task_dir.name}}
    run_dir = tmp_path / run["run_id"]
    run_dir.mkdir()
    return run, lifecycle.start(run, task_dir, run_dir, cfg, 240, force_compose=force_compose)


def leaves_nothing(docker_client, run):
    assert not docker_client.containers.list(all=True, filters={"label": f"termpool.run={run['run_id']}"})
    assert not docker_client.networks.list(filters={"label": f"termpool.run={run['run_id']}"})


def test_removals_of_one_run_at_once_all_succeed(docker_client, base_image):
    """A teardown and a failed start's cleanup (or a sweep) may remove a run together: Docker
    answers all but one with 409 "removal already in progress", which is not a failure."""
    for _ in range(3):
        run = {"run_id": "r" + uuid.uuid4().hex[:10]}
        docker_client.containers.run(
            base_image, ["sleep", "infinity"], detach=True, init=True, labels={"termpool.run": run["run_id"]}
        )
        assert not at_once(6, functools.partial(lifecycle.remove_run_resources, run["run_id"]))
        leaves_nothing(docker_client, run)


@pytest.mark.parametrize(
    "compose, word",
    [
        (
            CLIENT + "    environment:\n      - X=${TP_NOT_SET_ANYWHERE:?set TP_NOT_SET_ANYWHERE first}\n",
            "set TP_NOT_SET_ANYWHERE first",
        ),
        (CLIENT + "    image: [broken\n", "yaml"),
    ],
)
def test_invalid_files_are_task_invalid(tmp_path, docker_client, compose, word):
    cfg = settings(tmp_path)
    with pytest.raises(TaskInvalid) as err:
        start(task_copy(tmp_path, compose), cfg, tmp_path)
    assert word in str(err.value) and "docker-compose.yaml" in str(err.value)
    assert not (tmp_path / "sock").exists() or not list((tmp_path / "sock").iterdir())


def test_refused_files_are_task_unsupported(tmp_path, docker_client):
    cfg = settings(tmp_path)
    with pytest.raises(TaskUnsupported, match="network_mode: host"):
        start(task_copy(tmp_path, CLIENT + "    network_mode: host\n"), cfg, tmp_path)
    with pytest.raises(TaskUnsupported, match="Docker socket"):
        start(task_copy(tmp_path, CLIENT + "    volumes: [ '/var/run:/hostrun' ]\n", "t2"), cfg, tmp_path)


def build_locks(redis_server, cfg):
    """The workers' per-host build locks, on the test's Redis."""
    return functools.partial(Store(redis_server).build_lock, cfg.host_id)


def test_build_failure_names_the_task_and_log(tmp_path, redis_server):
    cfg = settings(tmp_path)
    with pytest.raises(TaskBuildFailed) as err:  # the SDK build of a one-service task
        task_builds.ensure_image(
            "broken-dockerfile", FIXTURES / "broken-dockerfile", cfg, 240, build_locks(redis_server, cfg)
        )
    assert str(FIXTURES / "broken-dockerfile" / "Dockerfile") in str(err.value)
    task_dir = task_copy(tmp_path, CLIENT + "  side:\n    build: ./side\n", "t-broken-side")
    (task_dir / "side").mkdir()
    (task_dir / "side" / "Dockerfile").write_text("FROM termpool-test-base:bookworm\nRUN echo side-marker && exit 7\n")
    with pytest.raises(TaskBuildFailed) as err:  # a compose build
        task_builds.ensure_image(task_dir.name, task_dir, cfg, 240, build_locks(redis_server, cfg))
    text = str(err.value)
    assert str(task_dir / "docker-compose.yaml") in text and "side-marker" in text and len(text) < 2600


@pytest.mark.parametrize(
    "sidecar, word",
    [
        (
            '    command: [ "sh", "-c", "echo sidecar-dies; exit 3" ]\n'
            '    healthcheck: {test: [ "CMD", "true" ], interval: 1s}\n',
            "sidecar-dies",
        ),
        (
            '    command: [ "sh", "-c", "echo never-healthy; sleep infinity" ]\n'
            '    healthcheck: {test: [ "CMD", "false" ], interval: 1s, retries: 2}\n',
            "unhealthy",
        ),
    ],
)
def test_failing_service_is_task_start_failed(tmp_path, docker_client, redis_server, sidecar, word):
    cfg = settings(tmp_path)
    compose = (
        CLIENT + "    depends_on: {side: {condition: service_healthy}}\n"
        "  side:\n    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}\n" + sidecar
    )
    task_dir = task_copy(tmp_path, compose, "t-start-" + word)
    task_builds.ensure_image(task_dir.name, task_dir, cfg, 240, build_locks(redis_server, cfg))
    run = {"run_id": "r" + uuid.uuid4().hex[:10], "task_key": task_dir.name, "task_meta": {"task_name": task_dir.name}}
    with pytest.raises(TaskStartFailed) as err:
        lifecycle.start(run, task_dir, tmp_path, cfg, 240)
    assert "'side'" in str(err.value) and word in str(err.value)
    leaves_nothing(docker_client, run)


# ---- the fast path gives the container compose gives ---------------------------------------
RUN_SPECIFIC_CONFIG = {"Hostname", "Labels", "Volumes"}
RUN_SPECIFIC_HOST = {"NetworkMode", "Binds"}


def normalised(container, run: dict, tmp_path: Path) -> dict:
    """A container's inspect without what differs per run (names, ids, times, paths)."""
    text = json.dumps(container.attrs)
    for value, placeholder in ((str(tmp_path), "<TMP>"), (run["run_id"], "<RUN>")):
        text = text.replace(value, placeholder)
    attrs = json.loads(text)
    config = {k: v for k, v in attrs["Config"].items() if k not in RUN_SPECIFIC_CONFIG}
    config["Env"] = sorted(config["Env"])  # compose and the SDK list variables in different orders
    config["Labels"] = {k: v for k, v in attrs["Config"]["Labels"].items() if not k.startswith("com.docker.compose.")}
    host = {k: v for k, v in attrs["HostConfig"].items() if k not in RUN_SPECIFIC_HOST and v not in (None, [], {})}
    host["Binds"] = sorted(attrs["HostConfig"]["Binds"] or [])
    mounts = sorted(attrs["Mounts"], key=lambda m: m["Destination"])
    return {
        "Config": config,
        "HostConfig": host,
        "Mounts": mounts,
        "Path": attrs["Path"],
        "Args": attrs["Args"],
        "Image": attrs["Image"],
        "Running": attrs["State"]["Running"],
    }


@pytest.mark.unit
def test_fast_path_applies_exactly_where_expected(tmp_path):
    cfg = settings(tmp_path)
    eligible = {
        d.name
        for d in FIXTURES.iterdir()
        if lifecycle.is_template(lifecycle.load_compose(d.name, d, cfg, 60), cfg, d, d.name)
    }
    assert eligible == FAST_PATH


# Harbor tasks with only a Dockerfile (tests/fixtures/harbor/): their generated one service
HARBOR_FAST_PATH = ["harbor/harbor-hello", "harbor/harbor-env"]


@pytest.mark.parametrize("task", sorted(FAST_PATH - {"broken-dockerfile"}) + HARBOR_FAST_PATH)
def test_fast_path_equals_compose(tmp_path, docker_client, redis_server, task):
    cfg = settings(tmp_path)
    task_dir = FIXTURES.parent / task if "/" in task else FIXTURES / task
    task_builds.ensure_image(task_dir.name, task_dir, cfg, 240, build_locks(redis_server, cfg))
    seen = {}
    for force in (False, True):
        run, (env, container) = start(task_dir, cfg, tmp_path, force_compose=force)
        try:
            assert env.mode == ("compose" if force else "direct")
            container.reload()
            seen[env.mode] = normalised(container, run, tmp_path)
            network = container.attrs["HostConfig"]["NetworkMode"]
            # The one deliberate difference: the fast path joins a termpool bridge with
            # inter-container traffic off, compose a per-project network (docs/task-format.md).
            shared = network.startswith(networks.ISOLATED_NAME.format(shard=""))
            assert network == f"{env.project}_default" if force else shared, network
        finally:
            lifecycle.remove_run_resources(run["run_id"], env.project)
        leaves_nothing(docker_client, run)
    assert seen["direct"] == seen["compose"]


@pytest.mark.parametrize(
    "task", ["sidecar-kv", "compose-limits", "compose-healthy-sidecar", "redis-db-sidecar", "compose-dockerfile-names"]
)
def test_other_files_fall_back_to_compose(tmp_path, docker_client, redis_server, task):
    cfg = settings(tmp_path)
    task_builds.ensure_image(task, FIXTURES / task, cfg, 240, build_locks(redis_server, cfg))
    run, (env, container) = start(FIXTURES / task, cfg, tmp_path)
    try:
        assert env.mode == "compose"
    finally:
        lifecycle.remove_run_resources(run["run_id"], env.project)
    leaves_nothing(docker_client, run)


def test_fixed_names_are_made_per_run(tmp_path, docker_client, redis_server):
    """compose-healthy-sidecar fixes a container_name and a network name: two live runs of it
    would collide unless termpool makes them per run (the fixed name stays an alias)."""
    cfg = settings(tmp_path)
    task_dir = FIXTURES / "compose-healthy-sidecar"
    task_builds.ensure_image(task_dir.name, task_dir, cfg, 240, build_locks(redis_server, cfg))
    runs = []
    try:
        for _ in range(2):
            run, (env, client) = start(task_dir, cfg, tmp_path)
            runs.append((run, env))
            sidecar = docker_client.containers.get(f"{env.project}-sidecar")
            network = docker_client.networks.get(f"{env.project}_backend")
            assert network.attrs["Labels"]["termpool.run"] == run["run_id"]
            assert "hs-sidecar" in sidecar.attrs["NetworkSettings"]["Networks"][network.name]["Aliases"]
            fetch = (
                "import urllib.request as u, sys; print(u.urlopen(f'http://{sys.argv[1]}:8000/token').read().decode())"
            )
            by_alias = client.exec_run(["python3", "-c", fetch, "hs-sidecar"]).output
            assert by_alias.startswith(b"sidecar-")  # this run's sidecar, not the other run's:
            assert by_alias == sidecar.exec_run(["python3", "-c", fetch, "127.0.0.1"]).output
    finally:
        for run, env in runs:
            lifecycle.remove_run_resources(run["run_id"], env.project)
    for run, _ in runs:
        leaves_nothing(docker_client, run)


# ---- whole episodes through the pool API ---------------------------------------------------
def episode(router, docker_client, task, checks):
    lease = router.allocate(task)
    try:
        reply = router.reset(lease, task)
        assert reply.status_code == 200, reply.text
        containers = {
            c.labels.get("com.docker.compose.service", "client"): c for c in router.run_containers(docker_client, lease)
        }
        checks(lease, containers)
        router.solve(lease, task)
        reply = router.evaluate(lease)
        assert reply.status_code == 200 and reply.json()["score"] == 1.0, reply.text
    finally:
        assert router.close(lease) == {"ok": True, "found": True}
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60), "teardown left containers"
    assert wait_for(lambda: not docker_client.networks.list(filters={"label": f"termpool.run={lease}"}), 30)


FORK_LOOP = """import os, time
kids = []
try:
    for _ in range(300):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        kids.append(pid)
    print("started", len(kids), "no limit")
except OSError as exc:
    print("started", len(kids), "stopped", exc.errno)
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
"""


def test_episode_compose_limits(router, docker_client):
    def checks(lease, containers):
        host = containers["client"].attrs["HostConfig"]
        assert host["NanoCpus"] == 1_000_000_000  # the task's cpus: '1' wins over CONTAINER_CPU_LIMIT
        assert host["Memory"] == host["MemorySwap"] == 512 * 1024**2  # the task's lower limit
        assert host["MemoryReservation"] == 256 * 1024**2 and host["PidsLimit"] == 128
        # fork until the pids limit stops it: far fewer than asked for, and the shell survives
        router.tool(lease, "shell_write_content_to_file", content=FORK_LOOP, file_path="/tmp/fork.py")
        out = router.sh(lease, "python3 /tmp/fork.py")
        started = int(out.split("started ")[1].split()[0])
        assert "stopped" in out and 10 < started < 128, out

    episode(router, docker_client, "compose-limits", checks)


def test_episode_compose_healthy_sidecar(router, docker_client):
    def checks(lease, containers):
        client, sidecar = containers["client"], containers["sidecar"]
        assert sidecar.image.tags == ["tb__compose-healthy-sidecar__sidecar:latest"]
        host = client.attrs["HostConfig"]
        assert host["Memory"] == GIB and host["NanoCpus"] == 500_000_000  # pool's lower memory, task's cpus
        ready = float(sidecar.exec_run(["cat", "/tmp/ready"]).output)  # written 3 s after the sidecar starts
        started = datetime.fromisoformat(client.attrs["State"]["StartedAt"][:26]).replace(tzinfo=UTC)
        assert started.timestamp() >= ready, "the client started before the sidecar was healthy"
        [network] = client.attrs["NetworkSettings"]["Networks"]
        assert network.endswith("_backend")
        assert docker_client.networks.get(network).attrs["Labels"]["termpool.run"] == lease

    episode(router, docker_client, "compose-healthy-sidecar", checks)


def test_episode_compose_env(router, docker_client):
    def checks(lease, containers):
        assert "com.docker.compose.project" not in containers["client"].labels  # the fast path
        assert containers["client"].attrs["HostConfig"]["NanoCpus"] == 2_000_000_000  # CONTAINER_CPU_LIMIT
        assert containers["client"].attrs["HostConfig"]["PidsLimit"] == 4096  # CONTAINER_PIDS_LIMIT
        assert containers["client"].attrs["Config"]["WorkingDir"] == "/work"  # the tools run in /workspace
        out = router.sh(lease, "id -u; echo $GREETING $FROM_ENV_FILE $LITERAL")
        assert out.split() == ["1000", "hello-default", "yes-from-env-file", "${NOT_INTERPOLATED}"]

    episode(router, docker_client, "compose-env", checks)


# ---- the container's own command, under tp-session boot -------------------------------------
IMAGE_CONFIG = {"Entrypoint": ["/entry.sh"], "Cmd": ["serve", "--port", "80"]}


@pytest.mark.unit
@pytest.mark.parametrize(
    "options, image, argv",
    [
        ({}, IMAGE_CONFIG, ["/entry.sh", "serve", "--port", "80"]),  # the image's own
        ({"command": ["sleep", "infinity"]}, IMAGE_CONFIG, ["/entry.sh", "sleep", "infinity"]),
        ({"command": "sleep 'a b'"}, IMAGE_CONFIG, ["/entry.sh", "sleep", "a b"]),  # split as the SDK does
        ({"entrypoint": ["/mine"]}, IMAGE_CONFIG, ["/mine"]),  # an entrypoint drops the image's command
        ({"entrypoint": ["/mine"], "command": ["x"]}, IMAGE_CONFIG, ["/mine", "x"]),
        ({"entrypoint": []}, IMAGE_CONFIG, ["serve", "--port", "80"]),  # empty, not unset: no entrypoint
        ({}, {"Entrypoint": None, "Cmd": ["bash"]}, ["bash"]),
        ({}, {}, []),
    ],
)
def test_own_command_is_what_docker_would_run(options, image, argv):
    assert container_spec.own_command(options, image) == argv


DOLLAR_CLIENT = CLIENT.replace(
    '[ "sh", "-c", "sleep infinity" ]', '[ "sh", "-c", "echo $$0 $${HOME} > /tmp/args; exec sleep infinity" ]'
)


@pytest.mark.parametrize("force_compose", [False, True])
def test_a_dollar_in_the_clients_command_reaches_it_as_written(tmp_path, docker_client, redis_server, force_compose):
    """`$$` in the task's file is a literal `$` for the container: the command tp-session boot
    runs is the one compose resolved, and the compose path's override does not interpolate it
    a second time."""
    cfg = settings(tmp_path)
    task_dir = task_copy(tmp_path, DOLLAR_CLIENT, name="dollar-task")
    task_builds.ensure_image(task_dir.name, task_dir, cfg, 240, build_locks(redis_server, cfg))
    run, (env, container) = start(task_dir, cfg, tmp_path, force_compose=force_compose)
    try:
        assert env.booted and env.mode == ("compose" if force_compose else "direct")
        assert container.attrs["Args"][-1] == "echo $0 ${HOME} > /tmp/args; exec sleep infinity"
        assert wait_for(lambda: container.exec_run(["cat", "/tmp/args"]).output == b"sh /root\n", 30)
    finally:
        lifecycle.remove_run_resources(run["run_id"], env.project)
        lifecycle.remove_ctl_dir(env.ctl_dir)
    leaves_nothing(docker_client, run)


@pytest.mark.unit
def test_a_start_that_meets_the_engine_away_leaves_no_socket_folder(tmp_path, monkeypatch):
    """The engine gone mid-start (a restart): the cleanup's own Docker calls fail too, and the
    run's socket folder (a file of this host, nothing else would remove it) goes all the same."""
    import requests

    def away(*_a, **_k):
        raise requests.exceptions.ConnectionError("('Connection aborted.', FileNotFoundError(2, 'No such file'))")

    cfg = settings(tmp_path)
    monkeypatch.setattr(lifecycle, "engine_cpus", lambda: 2.0)
    monkeypatch.setattr(networks, "isolated_network", lambda size: "termpool-isolated-0")
    monkeypatch.setattr(lifecycle, "start_direct", away)
    monkeypatch.setattr(lifecycle, "remove_run_resources", away)
    run = {"run_id": "run-away", "task_key": "hello-file", "task_meta": {"task_name": "hello-file"}}
    with pytest.raises(requests.exceptions.ConnectionError):
        lifecycle.start(run, FIXTURES / "hello-file", tmp_path / "out", cfg, 60)
    assert not (cfg.socket_dir / "run-away").exists()
    assert not list(cfg.socket_dir.parent.glob("sock/run-away*"))
