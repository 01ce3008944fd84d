"""scripts/serve.sh for real: every Procfile process under supervisord, a killed one comes
back (the gunicorn master too, without its old workers holding the port), and an interrupt
stops them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from deploy.supervisord_conf import render
from devstack import ROOT, WORKER_KINDS, Stack, free_port
from tests.conftest import Router, leftovers, wait_for


@pytest.fixture(scope="module")
def served(base_image, docker_client):
    s = Stack(env={"FLOWER_PORT": str(free_port()), "FLOWER_ADDRESS": "127.0.0.1"})
    s.env.update(TERMPOOL_RUN_DIR=str(s.workdir / "run"), TERMPOOL_LOG_DIR=str(s.workdir / "logs"))
    s.start_redis()  # private: start-backends.sh finds it answering and starts none
    s._spawn("serve", ["bash", "scripts/serve.sh"])
    s._wait(lambda: s.get("/healthz", timeout=2).ok, "scripts/serve.sh", 300)
    for kind in WORKER_KINDS:
        s.wait_worker(kind, pid=program_pid(s, kind))
    # serve.sh says when /readyz turns 200; its waiter, a child of supervisord, exits then.
    s._wait(lambda: "termpool: ready on port" in s.logs("serve"), "serve.sh's ready line", 120)
    yield s
    s.stop()
    for name in leftovers(docker_client, s.host_id):
        docker_client.containers.get(name).remove(force=True)


def supervisorctl(stack, *args) -> str:
    conf = os.path.join(stack.env["TERMPOOL_RUN_DIR"], "supervisord.conf")
    return subprocess.run(
        [sys.executable, "-m", "supervisor.supervisorctl", "-c", conf, *args],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


def program_pid(stack, name: str) -> int:
    out = supervisorctl(stack, "pid", name)
    return int(out) if out.isdigit() and out != "0" else 0


def restarted(stack, name: str, old: int) -> int:
    return wait_for(lambda: (pid := program_pid(stack, name)) not in (0, old) and pid, 120)


def gone(processes: list[psutil.Process]) -> bool:
    def alive(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return not any(alive(p) for p in processes)


def test_killed_workers_come_back_and_episodes_work(served, docker_client):
    for kind in ("build", "exec"):  # a prefork pool (its children must die with it) and a threads pool
        old = program_pid(served, kind)
        children = psutil.Process(old).children(recursive=True)
        os.kill(old, signal.SIGKILL)
        new = restarted(served, kind, old)
        assert new, f"{kind} was not restarted"
        served.wait_worker(kind, pid=new)
        assert wait_for(lambda: gone(children), 60), f"children of the killed {kind} worker linger"  # noqa: B023 (called in this iteration)

    assert Router(served).solved_episode(docker_client, "hello-file") == 1.0


def test_killed_gunicorn_master_comes_back(served):
    old = program_pid(served, "web")
    workers = psutil.Process(old).children()
    assert workers
    os.kill(old, signal.SIGKILL)
    assert restarted(served, "web", old), "gunicorn was not restarted"
    assert wait_for(lambda: gone(workers), 60), "the old master's workers linger"
    assert wait_for(lambda: _answers(served), 120), "the API does not answer again"
    assert served.get("/status").status_code == 200
    # The successor reuses the instance's runtime folder (no new one per unclean death) and
    # has its own control socket there, not one shared by every gunicorn of the host.
    runtime = f"/run/termpool-web/{served.port}"
    assert sorted(os.listdir(runtime)) == ["gunicorn.ctl", "prometheus"]
    ctl = subprocess.run(
        ["gunicornc", "-s", f"{runtime}/gunicorn.ctl", "-c", "show all", "-j"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ctl.returncode == 0, ctl.stderr
    assert json.loads(ctl.stdout)["arbiter"]["pid"] == program_pid(served, "web")


def _answers(stack) -> bool:
    try:
        return stack.get("/healthz", timeout=5).ok
    except OSError:
        return False


def test_interrupt_stops_every_process(served):
    supervisor = psutil.Process(served.procs["serve"].pid)
    tree = supervisor.children(recursive=True)
    assert len(supervisor.children()) == 8  # every Procfile process
    supervisor.send_signal(signal.SIGINT)  # Ctrl-C in the terminal running serve.sh
    assert served.procs["serve"].wait(timeout=120) == 0
    assert wait_for(lambda: gone(tree), 30), "processes outlived supervisord"
    logs = {p.name for p in (served.workdir / "logs").iterdir()}
    assert {f"{name}.log" for name in ("web", "scheduler", "flower", *WORKER_KINDS)} <= logs
    served.procs.pop("serve")


def test_config_keeps_procfile_commands_literal(tmp_path):
    conf = render({"web": "gunicorn --bind 0.0.0.0:$PORT 'x:make(\"%s\")'"}, ROOT, tmp_path, tmp_path)
    line = next(line for line in conf.splitlines() if line.startswith("command = "))
    assert line == """command = /bin/sh -c 'exec gunicorn --bind 0.0.0.0:$PORT '"'"'x:make("%%s")'"'"''"""
    assert "stopasgroup = true" in conf and "killasgroup = true" in conf and "nodaemon = true" in conf
