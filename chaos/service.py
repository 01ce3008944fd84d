"""The service under test, started exactly as it is run in production: `scripts/serve.sh`,
on private ports, a private Redis, its own host id and its own temp folders.

Processes are found by walking the process tree from the serve.sh pid and reading each
process's command line, so the harness does not depend on which launcher (honcho, a
supervisor) serve.sh uses. Processes are only ever signalled by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from devstack import FIXTURES, ROOT, free_port
from poolcore.config import QUEUE_KINDS, load_settings
from poolcore.processes import start_ticks
from poolcore.state import Store
from termpool.client import Pool

SLOW_DOCKERFILE = Path(__file__).resolve().parent / "fixtures" / "slow.Dockerfile"
BASE_TASK = "hello-file"  # every episode solves this fixture task (score 1.0 when solved)
WORKER_ROLES = (*QUEUE_KINDS, "beat")
ROLES = ("web", *WORKER_ROLES, "flower")
READY_TIMEOUT = 240.0
STOP_TIMEOUT = 40.0


def role_of(cmdline: list[str]) -> str | None:
    """Which Procfile process a command line is: `python3 -m tasks.worker build` is "build",
    `... -m gunicorn ...` is "web", `-m tasks.flower` is "flower". A `sh -c "..."` wrapper has
    the whole command in one argument and matches nothing."""
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "-m" and cmdline[i + 1] == "tasks.worker" and i + 2 < len(cmdline):
            return cmdline[i + 2] if cmdline[i + 2] in WORKER_ROLES else None
        if arg == "-m" and cmdline[i + 1] == "gunicorn":
            return "web"
        if arg == "-m" and cmdline[i + 1] == "tasks.flower":
            return "flower"
    if cmdline and os.path.basename(cmdline[0]) == "gunicorn":
        return "web"
    return None


class Service:
    """One serve.sh stack in its own temp folder; start(), the process lookups, stop()."""

    def __init__(self, workdir: Path, env: dict | None = None):
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host_id = "chaos" + uuid.uuid4().hex[:8]
        self.redis_port = free_port()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dataset = self.workdir / "dataset"
        self.socket_dir = self.workdir / "sockets"
        self.tmpdir = self.workdir / "tmp"
        for path in (self.dataset, self.socket_dir, self.tmpdir, self.workdir / "outputs"):
            path.mkdir(parents=True, exist_ok=True)
        # The dataset is a private folder: a copy of the fixture task (a few small files) and,
        # per build scenario, a slow-building variant of it under a fresh name.
        shutil.copytree(FIXTURES / BASE_TASK, self.dataset / BASE_TASK)
        self.env = {
            **os.environ,
            "REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "POOL_HOST_ID": self.host_id,
            "ENV_SERVER_PORT": str(self.port),
            "FLOWER_PORT": str(free_port()),
            "DATASET_DIR": str(self.dataset),
            "TBENCH_OUTPUT_ROOT": str(self.workdir / "outputs"),
            "POOL_SOCKET_DIR": str(self.socket_dir),
            "TMPDIR": str(self.tmpdir),  # so temp files the stack leaves are attributable
            # A launcher's own run and log folders (supervisord's config, socket and per-process
            # logs), private to this instance; ignored by launchers that do not use them.
            "TERMPOOL_RUN_DIR": str(self.workdir / "run"),
            "TERMPOOL_LOG_DIR": str(self.workdir / "logs"),
            "REDIS_DATA_DIR": str(self.workdir / "redis"),  # a durable Redis's files: never another instance's
            "CONTAINER_MEMORY_LIMIT": "1g",
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "serve.log"
        self.seen: dict[int, tuple[str, str]] = {}  # every stack pid seen: (its start in clock ticks, role)
        # The harness's own clients: no retries, short timeouts (Redis may be down on purpose).
        self.client = Pool(self.url, timeout=5, retries=0)
        self.redis = redis.Redis(
            host="127.0.0.1",
            port=self.redis_port,
            socket_timeout=5,
            socket_connect_timeout=2,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0),
        )
        self.images: list[str] = []  # images this run built (slow task variants), removed at the end

    # ---- start / stop ---------------------------------------------------------------------
    def start(self) -> None:
        self.launch()
        self.wait_ready(READY_TIMEOUT)

    def launch(self) -> None:
        """serve.sh, in the background: returns at once (wait_ready or wait_healthy after)."""
        log = open(self.log_path, "ab")  # noqa: SIM115 (serve.sh writes to it for the life of the service)
        self.proc = subprocess.Popen(
            ["bash", "scripts/serve.sh"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def wait_healthy(self, timeout: float = READY_TIMEOUT, poll: float = 0.05) -> float:
        """Wait for the first 200 of /healthz, as an impatient client polls it; the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if not self.alive():
                raise RuntimeError(f"serve.sh exited ({self.proc.returncode}); see {self.log_path}")
            if self.healthy():
                return time.monotonic() - started
            time.sleep(poll)
        raise RuntimeError(f"/healthz did not answer within {timeout:g} s; see {self.log_path}")

    def kill_everything(self) -> list[int]:
        """kill -9 of the whole stack at once, Redis included, as a crash or a power loss would
        (containers of live runs stay: they are dockerd's). Returns the pids killed."""
        procs = self.tree()
        redis_pid = self.redis_pid()
        if redis_pid:
            procs.append(psutil.Process(redis_pid))
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        return [proc.pid for proc in procs]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Every Procfile process is running, each worker pool has registered, /healthz answers."""
        deadline = time.monotonic() + timeout
        missing: list[str] = list(ROLES)
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"serve.sh exited ({self.proc.returncode}); see {self.log_path}")
            mains = self.mains()
            missing = [r for r in ROLES if r not in mains]
            if not missing:
                missing = [k for k in QUEUE_KINDS if not self.worker_registered(k, mains[k].pid)]
            if not missing and not self.healthy():
                missing = ["/healthz"]
            if not missing:
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the stack did not come up within {timeout:g} s (waiting for {missing}); see {self.log_path}"
        )

    def worker_registered(self, kind: str, pid: int) -> bool:
        from tasks.worker import node_name  # the node name the worker heartbeats under

        try:
            return Store(self.redis).node_alive(node_name(kind, self.host_id, pid))
        except redis.RedisError:
            return False

    def healthy(self) -> bool:
        return self.client.healthy()

    def stop(self) -> list[dict]:
        """Stop the service the way an operator would: SIGTERM to serve.sh's process (the
        launcher). Processes of the stack still running once it has exited are returned as
        leftovers, and are then stopped here (SIGTERM, SIGKILL 10 s later)."""
        self.snapshot()
        if self.alive():
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        time.sleep(1)
        left, procs = [], []
        redis_pid = self.redis_pid()
        for pid, (created, role) in sorted(self.seen.items()):
            if pid == redis_pid:
                continue  # the Redis, seen in the tree as it daemonized: stop_redis shuts it down
            try:
                proc = psutil.Process(pid)
                if start_ticks(pid) != created or proc.status() == psutil.STATUS_ZOMBIE:
                    continue  # gone, and the pid reused
                left.append({"pid": pid, "role": role, "cmdline": " ".join(proc.cmdline())[:120]})
                procs.append(proc)
                proc.terminate()
            except psutil.NoSuchProcess:
                continue
        for proc in psutil.wait_procs(procs, timeout=10)[1]:
            proc.kill()
        return left

    def stop_redis(self) -> None:
        """Shut the private Redis down (serve.sh started it daemonized, outside the tree)."""
        try:
            self.redis.shutdown(nosave=True)
        except redis.RedisError:
            pass

    # ---- the process tree -----------------------------------------------------------------
    def tree(self) -> list[psutil.Process]:
        if not self.alive():
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def snapshot(self) -> dict[int, tuple[psutil.Process, str | None, int]]:
        """pid -> (process, role, parent pid) of the stack's processes now (role None: a
        launcher or shell); every one is remembered for stop(). Processes that exit while
        the tree is read are left out."""
        found = {}
        for proc in self.tree():
            try:
                role = role_of(proc.cmdline())
                found[proc.pid] = (proc, role, proc.ppid())
                self.seen.setdefault(proc.pid, (start_ticks(proc.pid), role or proc.name()))
            except psutil.Error:
                continue
        return found

    def mains(self) -> dict[str, psutil.Process]:
        """The main process of each role: a process of that role whose parent is not of it
        (a gunicorn master, a Celery worker's parent, not its prefork children)."""
        procs = self.snapshot()
        found = {}
        for proc, role, ppid in procs.values():
            if role and (procs.get(ppid) or (None, None))[1] != role:
                found.setdefault(role, proc)
        return found

    def missing_roles(self) -> list[str]:
        mains = self.mains()
        return [role for role in ROLES if role not in mains]

    def children_of(self, role: str) -> list[psutil.Process]:
        """Processes of the same role under the role's main one (prefork children, gunicorn workers)."""
        procs = self.snapshot()
        main = self.mains().get(role)
        return [proc for proc, r, ppid in procs.values() if main and r == role and ppid == main.pid]

    # ---- Redis ------------------------------------------------------------------------------
    def redis_pid(self) -> int | None:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == self.redis_port and conn.pid:
                return conn.pid
        return None

    def store(self) -> Store:
        return Store.connect(load_settings(self.env))  # its one Redis, or its Sentinel primary

    def celery(self):
        from poolcore.queues import make_celery  # an app with the stack's broker and queues

        return make_celery(load_settings(self.env))

    # ---- tasks ------------------------------------------------------------------------------
    def slow_task(self, seconds: int) -> str:
        """A fresh task (never built before: a new name and a new RUN line) whose image build
        takes `seconds`; returns its name, which is also its path in the dataset."""
        name = f"chaos-slow-{uuid.uuid4().hex[:10]}"
        shutil.copytree(FIXTURES / BASE_TASK, self.dataset / name)
        text = SLOW_DOCKERFILE.read_text().format(nonce=name, seconds=seconds)
        (self.dataset / name / "Dockerfile").write_text(text)
        from poolcore.task_spec import image_name

        self.images.append(image_name(name))
        return name


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="chaos-"))
