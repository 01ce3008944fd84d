"""Flower (tasks/flower.py) against a real stack: every worker pool and queue, pool tasks by
name with their run id, basic auth on the HTTP API; and the launcher's arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import requests

from devstack import ROOT, WORKER_KINDS, free_port
from poolcore.config import FLOWER_TASK_COLUMNS, load_settings
from poolcore.queues import MAINTENANCE_QUEUE, queue_name
from tasks.flower import flower_argv
from tests.conftest import wait_for


# ---- the launcher's arguments (no stack) ------------------------------------------------------
@pytest.mark.unit
def test_argv_defaults_without_auth_bind_loopback():
    argv = flower_argv(load_settings({}))
    assert argv[0] == "flower"
    assert "--port=5555" in argv and "--address=127.0.0.1" in argv
    assert "--max_tasks=10000" in argv and f"--tasks_columns={FLOWER_TASK_COLUMNS}" in argv
    assert "--purge_offline_workers=3600" in argv
    assert not any(a.startswith("--basic_auth") for a in argv)


@pytest.mark.unit
def test_argv_with_auth_and_overrides():
    env = {
        "FLOWER_PORT": "6000",
        "FLOWER_MAX_TASKS": "500",
        "FLOWER_ADDRESS": "10.0.0.1",
        "FLOWER_TASKS_COLUMNS": "name,uuid",
        "FLOWER_BASIC_AUTH": "a:b, c:d",
    }
    argv = flower_argv(load_settings(env))
    assert {"--port=6000", "--max_tasks=500", "--address=10.0.0.1", "--basic_auth=a:b,c:d"} <= set(argv)
    assert "--tasks_columns=name,uuid" in argv
    assert "--address=0.0.0.0" in flower_argv(load_settings({"FLOWER_BASIC_AUTH": "a:b"}))


@pytest.mark.parametrize("auth", ["user", "user:", ":pw", "a:b,nopassword"])
@pytest.mark.unit
def test_malformed_basic_auth_is_refused(auth):
    with pytest.raises(SystemExit):
        flower_argv(load_settings({"FLOWER_BASIC_AUTH": auth}))


@pytest.mark.parametrize(
    "env", [{"FLOWER_PORT": "http"}, {"FLOWER_MAX_TASKS": "-1"}, {"FLOWER_PURGE_OFFLINE_WORKERS": "1h"}]
)
@pytest.mark.unit
def test_bad_numbers_are_refused(env):
    with pytest.raises(ValueError, match=next(iter(env))):
        load_settings(env)


# ---- Flower against the stack -------------------------------------------------------------------
@pytest.fixture
def flower(stack):
    """Flower on a free port with basic auth, as the Procfile starts it."""
    port = free_port()
    auth = ("termpool", uuid.uuid4().hex)
    name = f"flower-{port}"
    env = {
        **stack.env,
        "FLOWER_PORT": str(port),
        "FLOWER_BASIC_AUTH": f"{auth[0]}:{auth[1]}",
        "FLOWER_ADDRESS": "127.0.0.1",
        "LOG_LEVEL": "INFO",
    }
    log = open(stack.workdir / f"{name}.log", "ab")  # noqa: SIM115 (flower writes it until the teardown)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.flower"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stack.procs[name] = proc  # stack.stop() ends it should this test not get to
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, f"flower exited:\n{stack.logs(name)[-3000:]}"
        try:
            return requests.get(url + "/healthcheck", timeout=2).ok
        except requests.ConnectionError:
            return False

    assert wait_for(up, 60, 0.2), f"flower did not come up:\n{stack.logs(name)[-3000:]}"
    yield url, auth
    stack.procs.pop(name, None)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def _tasks_of_run(url, auth, run_id: str) -> dict:
    reply = requests.get(url + "/api/tasks", params={"limit": 1000}, auth=auth, timeout=10)
    assert reply.status_code == 200, reply.text
    return {tid: t for tid, t in reply.json().items() if run_id in (t.get("kwargs") or "")}


def _finished(tasks: dict) -> bool:
    return any(t.get("state") == "SUCCESS" and t.get("routing_key") for t in tasks.values())


def test_flower_shows_workers_queues_and_run_tasks(stack, router, flower, docker_client):
    url, auth = flower
    host = stack.host_id

    # The HTTP API needs the credentials.
    assert requests.get(url + "/api/workers", timeout=10).status_code == 401
    assert requests.get(url + "/api/workers", auth=(auth[0], "wrong"), timeout=10).status_code == 401
    assert requests.get(url + "/api/tasks", timeout=10).status_code == 401

    # Flower's HTTP server answers before its event receiver listens, and with TASK_EVENTS=monitor
    # events flow only once Flower has asked the workers and announced itself to the senders:
    # send probe jobs (the teardown of a lease never reset) until one shows up finished (its
    # worker's events) with its queue (the sender's), so the episode's events are all seen.
    def events_flow():
        probe = router.allocate("hello-file")
        router.close(probe)
        return wait_for(lambda: _finished(_tasks_of_run(url, auth, probe)), 5, 0.5)

    assert wait_for(events_flow, 120, 0), "Flower receives no task events"

    # One episode's worth of jobs: image, start, a tool call, close.
    lease = router.allocate("hello-file")
    reply = router.reset(lease, "hello-file")
    assert reply.status_code == 200, reply.text
    assert router.sh(lease, "echo flower-was-here").strip() == "flower-was-here"
    assert router.close(lease)["ok"] is True

    # Every worker pool of this host answers, each consuming its own queue.
    def workers():
        reply = requests.get(url + "/api/workers", params={"refresh": 1}, auth=auth, timeout=30)
        assert reply.status_code == 200, reply.text
        mine = {name: info for name, info in reply.json().items() if name.endswith(f"@{host}")}
        kinds = {name.split("-", 1)[0] for name in mine}
        return mine if set(WORKER_KINDS) <= kinds else None

    mine = wait_for(workers, 60, 1.0)
    assert mine, "Flower does not list a worker of every kind"
    consumed = {q["name"] for info in mine.values() for q in info.get("active_queues") or []}
    assert {queue_name(host, kind) for kind in WORKER_KINDS} | {MAINTENANCE_QUEUE} <= consumed

    # Flower's broker view lists those queues too.
    reply = requests.get(url + "/api/queues/length", auth=auth, timeout=30)
    assert reply.status_code == 200, reply.text
    listed = {q["name"] for q in reply.json()["active_queues"]}
    assert {queue_name(host, kind) for kind in WORKER_KINDS} <= listed

    # The run's tasks, by name, finished, with the run id in their kwargs (pool.ensure_image too,
    # unless the host already had the task's image).
    wanted = {"pool.start_run", "pool.exec_tool", "pool.close_run"}

    def run_tasks():
        done = {t["name"] for t in _tasks_of_run(url, auth, lease).values() if t.get("state") == "SUCCESS"}
        return wanted <= done

    assert wait_for(run_tasks, 90, 0.5), f"Flower has for run {lease}: {_tasks_of_run(url, auth, lease)}"
    tasks = _tasks_of_run(url, auth, lease)
    exec_tasks = [t for t in tasks.values() if t["name"] == "pool.exec_tool" and t["state"] == "SUCCESS"]
    assert exec_tasks
    task = exec_tasks[0]
    assert f"'run_id': '{lease}'" in task["kwargs"]
    assert task["worker"].startswith("exec-") and task["worker"].endswith(f"@{host}")
    assert task["routing_key"] == queue_name(host, "exec")

    # Filtering by task name, and the dashboard's search box finds a run's tasks by its id.
    reply = requests.get(
        url + "/api/tasks", params={"taskname": "pool.exec_tool", "state": "SUCCESS"}, auth=auth, timeout=10
    )
    assert reply.status_code == 200 and any(lease in (t.get("kwargs") or "") for t in reply.json().values())
    reply = requests.get(url + "/api/tasks", params={"search": lease}, auth=auth, timeout=10)
    assert reply.status_code == 200
    found = reply.json()
    assert wanted <= {t["name"] for t in found.values()}
    assert all(lease in t["kwargs"] for t in found.values())

    # The close finished (above), so the run's containers are gone.
    assert wait_for(lambda: not router.run_containers(docker_client, lease), 60)


# ---- task events only while a monitor asks for them (TASK_EVENTS=monitor) ----------------------
@pytest.mark.unit
def test_task_events_settings():
    from poolcore.config import load_settings
    from poolcore.queues import make_celery
    from tasks.worker import worker_argv

    assert "-E" not in worker_argv("exec")  # the flag would turn them on whatever the setting
    quiet = make_celery(load_settings({})).conf
    assert quiet.worker_send_task_events is False and quiet.task_send_sent_event is False
    loud = make_celery(load_settings({"TASK_EVENTS": "always"})).conf
    assert loud.worker_send_task_events is True and loud.task_send_sent_event is True
    with pytest.raises(ValueError, match="TASK_EVENTS"):
        load_settings({"TASK_EVENTS": "sometimes"})


class EventLog:
    """Every event of the stack's broker, captured by Celery's event receiver in a thread."""

    def __init__(self, celery):
        self.events: list[dict] = []
        self._conn = celery.connection()
        self._receiver = celery.events.Receiver(self._conn, handlers={"*": self.events.append})
        self._thread = threading.Thread(target=self._receiver.capture, kwargs={"limit": None}, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._receiver.should_stop = True
        self._thread.join(timeout=30)
        self._conn.release()

    def of(self, kind: str, host: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind and e.get("hostname", "").endswith(f"@{host}")]


def test_workers_send_task_events_only_once_asked(stack, router):
    from poolcore.config import load_settings
    from poolcore.queues import make_celery

    celery = make_celery(load_settings(stack.env))
    lease = router.allocate("hello-file")
    try:
        assert router.reset(lease, "hello-file").status_code == 200
        # Whatever an earlier Flower asked, this host's workers stop (as after a restart).
        celery.control.disable_events()
        with EventLog(celery) as log:
            assert wait_for(lambda: log.of("worker-heartbeat", stack.host_id), 30, 0.2), "no event arrives"
            assert router.sh(lease, "echo quiet").strip() == "quiet"
            time.sleep(2)
            assert not log.of("task-succeeded", stack.host_id), "task events sent while no monitor asked"
            # What Flower does every few seconds: ask every worker for task events.
            celery.control.enable_events()
            assert router.sh(lease, "echo heard").strip() == "heard"
            assert wait_for(lambda: log.of("task-succeeded", stack.host_id), 30, 0.2), "no task event once asked"
    finally:
        router.close(lease)
        celery.close()
