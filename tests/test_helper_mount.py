"""The session helper mounted read-only from the host (session_helper.helper_mount): a started
run's container has it without a copy, the task cannot change or remove it, the folders the
archive used to make are there with the same modes and owners for root, numeric and named
users, the server runs as before, a helper from an older version is replaced host-side, and
teardown leaves no folder behind."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from devstack import FIXTURES, ROOT
from environments import lifecycle, task_builds
from environments.docker_client import KnownContainer
from environments.session_helper import (
    BIN_DIR,
    CTL_SOCKET,
    HELPER_PATH,
    SESSIONS_ROOT,
    WORKSPACE,
    helper_mount,
    mounted_helper_dir,
    prepare_container,
)
from environments.tools import run_tool, server_socket
from tests.conftest import wait_for
from tests.test_compose_fidelity import build_locks, settings
from tests.test_output_caps import OLD_HELPER_COMMIT, OLD_HELPER_SOURCE, MemorySessions


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return settings(tmp_path_factory.mktemp("helper-mount"))


@pytest.fixture(scope="module")
def images(cfg, redis_server, base_image):
    for task in ("hello-file", "compose-env"):
        task_builds.ensure_image(task, FIXTURES / task, cfg, 240, build_locks(redis_server, cfg))


@pytest.fixture
def unbooted(monkeypatch):
    """Root containers started as before tp-session boot (an older worker's): the server is
    started by an exec."""
    monkeypatch.setattr(lifecycle, "boot_server", lambda resolved, client, task_name: {})


def start(cfg, task: str, tmp_path: Path):
    run = {"run_id": "r" + uuid.uuid4().hex[:10], "task_key": task, "task_meta": {"task_name": task}}
    run_dir = tmp_path / run["run_id"]
    for sub in ("sessions", "agent-logs"):
        (run_dir / sub).mkdir(parents=True)
    env, container = lifecycle.start(run, FIXTURES / task, run_dir, cfg, 240)
    return run, env, container


def stat(container, path: str) -> str:
    return container.exec_run(["stat", "-c", "%a %u %g %F", path], user="root").output.decode().strip()


def shell(env, container, command: str, sessions=None) -> str:
    model = KnownContainer(container.client, container.name, env.user)  # as the pool passes it
    return run_tool(
        model,
        "shell_exec",
        {"id": "t", "command": command},
        sessions if sessions is not None else MemorySessions(),
        ctl_socket=lifecycle.ctl_socket(env.to_dict()),
    )


def teardown(run, env) -> None:
    lifecycle.remove_run_resources(run["run_id"], env.project)
    lifecycle.remove_ctl_dir(env.ctl_dir)
    assert not Path(env.ctl_dir).exists() and not Path(env.ctl_dir + ".bin").exists()


def test_root_container_gets_a_read_only_helper_and_starts_its_own_server(cfg, images, tmp_path):
    run, env, container = start(cfg, "hello-file", tmp_path)
    try:
        host_dir = mounted_helper_dir(container)
        assert host_dir == env.ctl_dir + ".bin"
        mount = next(m for m in container.attrs["Mounts"] if m["Destination"] == BIN_DIR)
        assert mount["RW"] is False
        # tp-session boot, the entrypoint, started the server: no exec, and the task's command runs
        assert env.booted and container.attrs["Path"] == HELPER_PATH
        assert container.attrs["Args"][-4:] == ["--", "sh", "-c", "sleep infinity"]
        assert wait_for(lambda: server_socket.server_answers(lifecycle.ctl_socket(env.to_dict())), 30)
        assert shell(env, container, "echo served") == "served\n"
        container.reload()
        assert not container.attrs["ExecIDs"], "a docker exec ran in a booted container"
        assert stat(container, SESSIONS_ROOT) == "1777 0 0 directory"
        assert stat(container, WORKSPACE) == "755 0 0 directory"
        servers = container.exec_run(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; true"]).output
        assert f"{HELPER_PATH} serve {CTL_SOCKET}".encode() in servers  # as start_server names it
        assert shell(env, container, "pwd; echo hi") == "/workspace\nhi\n"
        # the task, root in its container, can neither change nor remove the helper
        before = hashlib.sha256((Path(host_dir) / "tp-session").read_bytes()).hexdigest()
        for attack in (f"echo x > {HELPER_PATH}", f"rm -f {HELPER_PATH}", f"chmod 777 {HELPER_PATH}"):
            assert container.exec_run(["sh", "-c", attack], user="root").exit_code != 0, attack
        assert container.exec_run(["sh", "-c", f"touch {BIN_DIR}/new"], user="root").exit_code != 0
        assert hashlib.sha256((Path(host_dir) / "tp-session").read_bytes()).hexdigest() == before
        # a workspace the task removed is made again (setup through the mounted helper)
        container.exec_run(["rm", "-rf", WORKSPACE], user="root")
        assert shell(env, container, "pwd") == "/workspace\n"
    finally:
        teardown(run, env)


def test_a_booted_root_container_runs_the_tasks_own_entrypoint_and_command(cfg, images, tmp_path, redis_server):
    """compose-env as root: its entrypoint (which leaves a mark) and then its command run
    under tp-session boot as they would without it."""
    task_dir = shutil.copytree(FIXTURES / "compose-env", tmp_path / "tasks" / "compose-env")
    compose = task_dir / "docker-compose.yaml"
    compose.write_text(compose.read_text().replace('    user: "1000:1000"\n', ""))
    task_builds.ensure_image("compose-env", task_dir, cfg, 240, build_locks(redis_server, cfg))
    run = {"run_id": "r" + uuid.uuid4().hex[:10], "task_key": "compose-env", "task_meta": {"task_name": "compose-env"}}
    run_dir = tmp_path / run["run_id"]
    for sub in ("sessions", "agent-logs"):
        (run_dir / sub).mkdir(parents=True)
    env, container = lifecycle.start(run, task_dir, run_dir, cfg, 240)
    try:
        assert env.booted and env.mode == "direct"
        assert container.attrs["Args"][-4:] == ["--", "/usr/local/bin/entry.sh", "sleep", "infinity"]
        commands = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
        assert shell(env, container, f"cat /tmp/entrypoint-ran; {commands} | grep -cx 'sleep infinity '") == "0\n1\n"
    finally:
        teardown(run, env)


def test_numeric_user_gets_its_workspace(cfg, images, tmp_path):
    run, env, container = start(cfg, "compose-env", tmp_path)  # user 1000:1000
    try:
        assert mounted_helper_dir(container) and not env.booted  # its folders need an exec as root
        prepare_container(container, serve=True)
        assert stat(container, SESSIONS_ROOT) == "1777 0 0 directory"
        assert stat(container, WORKSPACE) == "755 1000 1000 directory"
        assert shell(env, container, "id -u; pwd") == "1000\n/workspace\n"
    finally:
        teardown(run, env)


def test_named_user_gets_its_workspace(cfg, images, tmp_path, docker_client):
    """A container of a user given by name (the chown by name path), with the pool's mounts."""
    ctl = lifecycle.make_ctl_dir(cfg, "named-" + uuid.uuid4().hex[:8])
    container = docker_client.containers.run(
        "tb__hello-file__client",
        ["sleep", "infinity"],
        detach=True,
        user="nobody",
        labels={"termpool.host": cfg.host_id},
        volumes=[f"{ctl}:/.termpool/ctl:rw", helper_mount(ctl)],
    )
    try:
        prepare_container(container, serve=True)
        assert stat(container, WORKSPACE) == "755 65534 0 directory"  # chown by name: the owner only
        env = lifecycle.RunEnv("direct", container.name, container.name, "", ctl_dir=str(ctl), user="nobody")
        assert shell(env, container, "id -un; pwd") == "nobody\n/workspace\n"
    finally:
        container.remove(force=True)
        lifecycle.remove_ctl_dir(str(ctl))


def test_a_mounted_helper_from_an_older_version_is_replaced(cfg, images, tmp_path):
    """A run that outlived an upgrade of its workers has the old helper in its mounted folder:
    the first call that the old helper refuses links the current one there, host-side."""
    source = subprocess.run(
        ["git", "show", f"{OLD_HELPER_COMMIT}:{OLD_HELPER_SOURCE}"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    (tmp_path / "tp_session.c").write_bytes(source)
    old = tmp_path / "tp-session"
    subprocess.run(
        ["gcc", "-O2", "-static", "-o", str(old), str(tmp_path / "tp_session.c"), "-lutil"],
        check=True,
        capture_output=True,
    )
    run, env, container = start(cfg, "hello-file", tmp_path)
    try:
        prepare_container(container)  # folders only: no server, so calls go through docker exec
        host_file = Path(mounted_helper_dir(container)) / "tp-session"
        host_file.unlink()
        shutil.copyfile(old, host_file)
        host_file.chmod(0o755)
        no_server = dataclasses.replace(env, ctl_dir="")  # the helper is run by docker exec
        assert shell(no_server, container, "echo hi") == "hi\n"
        assert host_file.read_bytes() != old.read_bytes()
    finally:
        teardown(run, env)


def test_a_call_to_an_unprepared_container_is_served_and_prepares(cfg, images, tmp_path, unbooted):
    """A root container with neither server nor folders (an older worker's, or a task that
    removed everything): the call goes through docker exec, which makes them, and the server
    is started again for the next call."""
    run, env, container = start(cfg, "hello-file", tmp_path)
    try:
        assert container.exec_run(["test", "-e", WORKSPACE]).exit_code != 0  # nothing prepared yet
        assert shell(env, container, "pwd; echo early") == "/workspace\nearly\n"
        assert stat(container, SESSIONS_ROOT) == "1777 0 0 directory"
        assert wait_for(lambda: Path(lifecycle.ctl_socket(env.to_dict())).exists(), 30)  # restarted meanwhile
        assert shell(env, container, "echo served") == "served\n"
    finally:
        teardown(run, env)


def test_a_call_right_after_the_start_is_served_by_the_booted_server(cfg, images, tmp_path):
    """The reset replies once the container runs; a call that comes before tp-session boot's
    server listens waits for it rather than going through a docker exec of its own (and a
    second server start)."""
    run, env, container = start(cfg, "hello-file", tmp_path)
    try:
        assert shell(env, container, "echo first") == "first\n"
        # served by the server: the fallback (docker exec) would have asked for a restart
        assert lifecycle.ctl_socket(env.to_dict()) not in server_socket.restarts_asked
        container.reload()
        assert not container.attrs["ExecIDs"]
    finally:
        teardown(run, env)
