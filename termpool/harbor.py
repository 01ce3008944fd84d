"""termpool as a Harbor environment backend: Harbor's own trials (its agents, its verifier) on a
termpool pool of one or many hosts.

    harbor run -p TASK -a oracle -e termpool.harbor:TermpoolEnvironment --ek url=http://HOST:18081

Options (`--ek key=value`, else the environment): `url` (TERMPOOL_URL, default
http://127.0.0.1:18081) and `token` (TERMPOOL_TOKEN). Needs Python >= 3.12 with `harbor` and
httpx; nothing of termpool's server (docs/harbor.md).

How each call is carried out:
- start: the task's environment/ and its effective [environment] settings (after Harbor's
  --override-* flags and network policy) are sent once as an uploaded task, named by its content
  digest (POST /v1/tasks); a run of it starts on whichever host the pool places it, which builds
  the image once; then the log folders are made, as Harbor's base class does.
- exec: a command job of the run (`bash -c`, stdout and stderr apart, cwd/env/user/timeout);
  cancelling the coroutine cancels the job, which kills what the command started.
- upload_file/upload_dir/download_file/download_dir: tar archives through the run's archive jobs.
- stop: closes the run and waits for its teardown; never raises.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities

from termpool.client import AsyncPool, TermpoolError
from termpool.client.pool_ops import DEFAULT_URL

STOP_WAIT_SEC = 120.0  # how long stop waits for the run's teardown before it gives up (and logs)


class TermpoolEnvironment(BaseEnvironment):
    """A Harbor environment whose containers run on a termpool pool (docs/harbor.md)."""

    def __init__(self, *args, url: str | None = None, token: str | None = None, **kwargs):
        # Set before the base class's __init__, which reads `capabilities`.
        self._url = url or os.environ.get("TERMPOOL_URL") or DEFAULT_URL
        self._token = token or os.environ.get("TERMPOOL_TOKEN") or None
        self._pool: AsyncPool | None = None
        self._run = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "termpool"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # No GPUs, no host mounts, no per-service operations on compose sidecars: not claimed.
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _validate_definition(self):
        env_dir = self.environment_dir
        if self.task_env_config.docker_image:
            return
        if not (env_dir / "Dockerfile").is_file() and not (env_dir / "docker-compose.yaml").is_file():
            raise FileNotFoundError(f"{env_dir} has neither a Dockerfile nor a docker-compose.yaml")

    # ---- the run's life -------------------------------------------------------------------
    async def start(self, force_build: bool) -> None:
        # force_build needs nothing: an uploaded task is built once per host from its content, so
        # a changed environment/ is a new digest and a new build.
        self._pool = AsyncPool(self._url, token=self._token)
        with tempfile.TemporaryDirectory(prefix="termpool-harbor-") as folder:
            self._write_task_folder(Path(folder))
            task_path = await self._pool.upload_task(folder)
        self._run = await self._pool.start(
            self.environment_name, task_path=task_path, request_id=self.session_id, wait=False
        )
        await self._run.wait_ready()
        await self._upload_environment_dir_after_start()
        await self.ensure_dirs(self._mount_targets(writable_only=True))

    async def stop(self, delete: bool):
        """Close the run (its containers go, whatever `delete` says: a pool keeps nothing of a
        closed run) and the pool's connections. Called after a failed start too; never raises."""
        run, pool, self._run, self._pool = self._run, self._pool, None, None
        try:
            if run is not None:
                await asyncio.wait_for(run.close(wait=True), STOP_WAIT_SEC)
        except (TermpoolError, TimeoutError, OSError) as exc:
            self.logger.warning(f"termpool: closing run {run.id} failed: {exc}")
        finally:
            if pool is not None:
                await pool.close()

    def _write_task_folder(self, folder: Path) -> None:
        """The task as termpool receives it: environment/ and a task.toml of its effective
        [environment] settings (Harbor's overrides applied), no instruction and no tests."""
        if self.environment_dir.is_dir():
            shutil.copytree(self.environment_dir, folder / "environment", symlinks=True)
        (folder / "task.toml").write_text(_environment_toml(self._environment_settings()))

    def _environment_settings(self) -> dict:
        cfg = self.task_env_config
        settings = {
            "build_timeout_sec": float(cfg.build_timeout_sec),
            "cpus": self._effective_cpus,
            "memory_mb": self._effective_memory_mb,
            "storage_mb": self._effective_storage_mb,
            "docker_image": cfg.docker_image,
            "workdir": cfg.workdir,
            "allow_internet": not self._network_disabled,
        }
        return {key: value for key, value in settings.items() if value is not None}

    # ---- commands -------------------------------------------------------------------------
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        result = await self._live_run().command(
            command,
            cwd=cwd or self.task_env_config.workdir,
            env=self._merge_env(env),
            user=self._resolve_user(user),
            timeout_sec=timeout_sec,
        )
        await self._emit_output(result.stdout, result.stderr)
        if result.timed_out:  # what Harbor's Docker environment raises (its process is killed too)
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=result.stdout or None, stderr=result.stderr or None, return_code=result.return_code)

    async def _emit_output(self, stdout: str, stderr: str) -> None:
        """A command's output reaches Harbor's output callbacks when it ends (no streaming)."""
        callback = self._output_callback()
        if callback is None:
            return
        for text, stream in ((stdout, "stdout"), (stderr, "stderr")):
            if text:
                await callback(text, stream)

    # ---- files ----------------------------------------------------------------------------
    async def upload_file(self, source_path: Path | str, target_path: str):
        await self._live_run().upload_file(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str):
        await self._live_run().upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str):
        await self._live_run().download_file(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str):
        await self._live_run().download_dir(source_dir, target_dir)

    def _live_run(self):
        if self._run is None:
            raise RuntimeError("the termpool environment is not started")
        return self._run


def _environment_toml(settings: dict) -> str:
    """A task.toml of one [environment] table of scalars (JSON strings, numbers and booleans
    are TOML's too)."""
    lines = ["[environment]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"
