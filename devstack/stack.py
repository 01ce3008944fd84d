"""Start a whole termpool stack as real processes: redis-server, one Celery worker per queue
kind, beat, and gunicorn serving the facade, on free ports with a random host id. Used by the
tests, the benchmark and the chaos suite; the dataset is the fixture tasks unless DATASET_DIR
is given."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
import requests

from devstack.slots import take_slot
from poolcore.config import load_settings
from poolcore.state import Store, connection
from tasks.worker import node_name
from termpool.client import Pool

ROOT = Path(__file__).resolve().parent.parent
# Stacks on this machine's daemon run side by side (a test session's, a module's own, a
# benchmark's): each gives its runs' networks a range of its own, or two would hand out the
# same blocks and Docker would refuse the second ("Pool overlaps"). Away from Docker's own
# pools (172.17-31.x, 192.168.x) and the second daemons' (devstack/second_docker.py: 10.213-217.x).
SUBNET_SLOTS = 16
SUBNET_LOCK = "/run/termpool-stack-subnets-{slot}.lock"
FIXTURES = ROOT / "tests" / "fixtures" / "tasks"
WORKER_KINDS = ("build", "lifecycle", "exec", "eval", "teardown")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    def __init__(
        self,
        env: dict | None = None,
        beat: bool = False,
        workdir: Path | None = None,
        durable_redis: bool = False,
        redis_group=None,
    ):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="termpool-stack-"))
        self.redis_port = free_port()
        self.port = free_port()
        self.host_id = "t" + uuid.uuid4().hex[:8]
        self._subnet_lock, self._subnet_slot = None, 0
        self._own_subnets = "RUN_SUBNETS" not in (env or {})
        self.output_root = self.workdir / "outputs"
        self.output_root.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "POOL_HOST_ID": self.host_id,
            "ENV_SERVER_PORT": str(self.port),
            "DATASET_DIR": str(FIXTURES),
            "TBENCH_OUTPUT_ROOT": str(self.output_root),
            "UPLOADED_TASKS_DIR": str(self.workdir / "uploaded-tasks"),
            "CONTAINER_MEMORY_LIMIT": "1g",
            "EXEC_CONCURRENCY": "16",
            "LIFECYCLE_CONCURRENCY": "8",
            "EVAL_CONCURRENCY": "8",
            "TEARDOWN_CONCURRENCY": "4",
            "LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
            # Each test stack is a pool of its own: a registry shared between them would let one
            # test's build serve another's. A test of the pool's registry gives its own.
            "REGISTRY_URL": "off",
            # A Sentinel deployment (devstack/sentinel.py SentinelGroup) instead of one Redis:
            # REDIS_URL then names a port nothing listens on, so a client made without the
            # sentinels fails instead of passing unnoticed.
            **(redis_group.settings_env() if redis_group else {}),
            **(env or {}),
        }
        self.redis_group = redis_group
        self.beat = beat
        # durable_redis: an append-only file in the workdir, fsynced every second, as the
        # deployments run it (scripts/start-backends.sh, docker-compose.yml).
        persistence = (
            ["--dir", str(self.workdir), "--appendonly", "yes", "--appendfsync", "everysec"]
            if durable_redis
            else ["--appendonly", "no"]
        )
        self.redis_argv = [
            "redis-server",
            "--port",
            str(self.redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *persistence,
            "--maxmemory-policy",
            "noeviction",
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.extra_hosts: dict[str, dict] = {}  # host id -> environment of its workers (start_host)
        self.revived: list[str] = []  # worker kinds started again after they exited (revive)
        self.url = f"http://127.0.0.1:{self.port}"

    # ---- processes ------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child's stdout: it outlives this call)
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def start_redis(self) -> None:
        if self.redis_group:
            self.redis_group.start()
            self.redis = connection.client(load_settings(self.env))  # the primary, after failovers too
            return
        self._spawn("redis", self.redis_argv)
        self.redis = redis.Redis(port=self.redis_port, decode_responses=True)
        self._wait(lambda: self.redis.ping(), "redis")

    def restart_redis(self, down_for: float = 0.0) -> None:
        """SHUTDOWN NOSAVE (an AOF is still flushed), then the same command again."""
        proc = self.procs.pop("redis")
        try:
            self.redis.shutdown(nosave=True)
        except redis.exceptions.ConnectionError:
            pass  # the server closes the connection as it goes
        proc.wait(timeout=60)
        time.sleep(down_for)
        self.start_redis()
        self.revive()

    def revive(self) -> list[str]:
        """Start again the worker processes (and beat) that exited, as the service's supervisor
        does. Celery on Redis can lose a worker to a broker outage (kombu restoring unacked
        messages on a dead connection: "Unrecoverable error"); serve.sh's supervisord and the
        compose restart policies start it again. Returns the kinds started again (self.revived)."""
        revived = []
        for kind in (*WORKER_KINDS, *(("beat",) if self.beat else ())):
            proc = self.procs.get(kind)
            if proc is not None and proc.poll() is not None:
                if kind == "beat":
                    self._spawn("beat", [sys.executable, "-m", "tasks.worker", "beat"])
                else:
                    self.start_worker(kind)
                revived.append(kind)
        self.revived += revived
        return revived

    def start(self) -> Stack:
        """Every process; a stack that does not come up is stopped again (nothing left running)."""
        try:
            self._take_subnets()
            self.start_redis()
            for kind in WORKER_KINDS:
                self.start_worker(kind, wait=False)
            if self.beat:
                self._spawn("beat", [sys.executable, "-m", "tasks.worker", "beat"])
            self._spawn("web", [sys.executable, "-m", "gunicorn", "-c", "app/gunicorn_conf.py", "app:create_app()"])
            self._wait(self.client.healthy, "gunicorn")
            for kind in WORKER_KINDS:
                self.wait_worker(kind)
            self.wait_serving(self.host_id)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self, kind: str, wait: bool = True) -> None:
        self._spawn(kind, [sys.executable, "-m", "tasks.worker", kind])
        if wait:
            self.wait_worker(kind)

    def wait_worker(self, kind: str, pid: int | None = None, host: str | None = None) -> None:
        """Wait for the heartbeat of the worker of this kind (started here, or given by pid)."""
        pid = pid or self.procs[kind].pid
        node = node_name(kind, host or self.host_id, pid)
        self._wait(lambda: Store(self.redis).node_alive(node), f"{kind} worker", 60)

    # ---- more worker hosts on this stack's Redis and facade --------------------------------
    def start_host(self, host_id: str, env: dict | None = None) -> list[str]:
        """Start the worker processes of another worker host, every queue kind (as Procfile.worker
        does), with its own POOL_HOST_ID and, in env, its own DOCKER_HOST; returns their names
        in self.procs ("<host>:<kind>")."""
        own = {"UPLOADED_TASKS_DIR": str(self.workdir / f"uploaded-tasks-{host_id}")}  # hosts share no folder
        host_env = self.extra_hosts.setdefault(host_id, {**self.env, **own, **(env or {}), "POOL_HOST_ID": host_id})
        names = [f"{host_id}:{kind}" for kind in WORKER_KINDS]
        for name, kind in zip(names, WORKER_KINDS):
            self._spawn(name, [sys.executable, "-m", "tasks.worker", kind], env=host_env)
        for name, kind in zip(names, WORKER_KINDS):
            self.wait_worker(kind, self.procs[name].pid, host_id)
        self.wait_serving(host_id)
        return names

    def wait_serving(self, host: str, timeout: float = 60) -> None:
        """Wait until the facade has seen every queue kind of the host alive: it judges only
        workers it saw beat (poolcore/liveness.py), so a test that stops one right after a start
        sees it judged. Each gunicorn worker process watches on its own: several answers in a
        row, each on a new connection, so that they likely come from more than one of them."""
        in_a_row = [0]
        token = self.env.get("POOL_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        def serving() -> bool:
            reply = requests.get(self.url + "/status", headers=headers, timeout=5)
            state = reply.json()["pool"]["hosts"].get(host, {}).get("state")
            in_a_row[0] = in_a_row[0] + 1 if state == "serving" else 0
            return in_a_row[0] >= 2 * int(self.env.get("WEB_CONCURRENCY", "2"))

        self._wait(serving, f"host {host} serving", timeout)

    def kill_host(self, host_id: str, sig=signal.SIGKILL) -> None:
        """Signal every worker process of a host started by start_host (SIGKILL: the host is lost)."""
        procs = [self.procs.pop(name) for name in [n for n in self.procs if n.startswith(host_id + ":")]]
        for proc in procs:  # all at once, as a machine dies: no survivor sees the others go
            os.killpg(proc.pid, sig)
        for proc in procs:
            proc.wait(timeout=60)

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM to every process, Redis last: a worker's clean stop still reaches Redis (the
        lifecycle worker removes its host's warm spares)."""
        for group in ([n for n in self.procs if n != "redis"], ["redis"]):
            for name in group:
                proc = self.procs.get(name)
                if proc and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for name in group:
                proc = self.procs.get(name)
                if proc is None:
                    continue
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
        self.procs.clear()
        if self.redis_group:
            self.redis_group.stop()
        if "client" in vars(self):
            self.client.close()
            del self.client  # a restarted stack gets a new one
        for env in (self.env, *self.extra_hosts.values()):
            self._remove_containment(env)
        self._give_back_subnets()

    def _take_subnets(self) -> None:
        """A range of its own for the stack's runs while it runs (its last slot when free)."""
        if self._own_subnets and self._subnet_lock is None:
            slot, self._subnet_lock = take_slot(SUBNET_LOCK, SUBNET_SLOTS, 1800.0, prefer=self._subnet_slot)
            self._subnet_slot = slot
            self.env["RUN_SUBNETS"] = f"10.{192 + slot}.0.0/16"

    def _give_back_subnets(self) -> None:
        if self._subnet_lock is not None:
            self._subnet_lock.close()
            self._subnet_lock = None

    def _remove_containment(self, env: dict) -> None:
        """Drop the packet-filter rules a host's workers installed (environments/containment.py)."""
        from environments import containment

        cfg = load_settings(env)
        if cfg.containment != "off":
            try:
                containment.remove(cfg)
            except Exception:
                pass  # no iptables here (not root): the workers installed nothing either

    def _wait(self, check, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not come up; logs in {self.workdir}")

    def logs(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    # ---- HTTP -----------------------------------------------------------------------------
    @functools.cached_property
    def client(self) -> Pool:
        """termpool.client on this stack, without retries: its caller sees every failure."""
        return Pool(self.url, timeout=60, job_timeout=600, retries=0)

    # Raw requests, for tests that check the HTTP reply itself (status code, headers, bytes).
    def post(self, path: str, body=None, timeout: float = 600, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout, **kw)

    def get(self, path: str, timeout: float = 60, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout, **kw)
