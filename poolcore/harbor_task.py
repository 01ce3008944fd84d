"""Read a task folder in Harbor's format (Terminal-Bench 2.0; docs/task-format.md).

A Harbor task is a folder with task.toml and instruction.md; its image comes from
environment/ (a Dockerfile, or a docker-compose.yaml whose `main` service is the agent's),
its grader is tests/test.sh and its reference solution solution/solve.sh. Pure logic + tomllib:
the facade and `dataset check` call this too.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HARBOR_FILES = ("task.toml", "instruction.md")
ENVIRONMENT_DIR = "environment"
MAIN_SERVICE = "main"  # Harbor's name for the agent's service
# Harbor's defaults (harbor: src/harbor/models/task/config.py)
VERIFIER_TIMEOUT_SEC = 600.0
BUILD_TIMEOUT_SEC = 600.0
CPUS = 1.0
MEMORY_MB = 2048


class HarborTaskError(ValueError):
    """task.toml or a required file is missing or malformed."""


class HarborUnsupported(HarborTaskError):
    """The task asks for something termpool does not do (multi-step tasks, GPUs, ...)."""


@dataclass(frozen=True)
class HarborConfig:
    """What termpool uses of task.toml beyond the instruction and the two timeouts."""

    verifier_timeout_sec: float = VERIFIER_TIMEOUT_SEC
    verifier_env: dict = field(default_factory=dict)
    verifier_user: str = ""
    solution_env: dict = field(default_factory=dict)
    build_timeout_sec: float = BUILD_TIMEOUT_SEC
    cpus: float = CPUS
    memory_mb: int = MEMORY_MB
    docker_image: str = ""
    allow_internet: bool = True
    has_compose: bool = False  # environment/docker-compose.yaml, layered over the generated base
    has_dockerfile: bool = True  # environment/Dockerfile; without it only docker_image gives the image
    storage_mb: int | None = None  # environment.storage_mb (or the deprecated storage "10G")
    workdir: str = ""  # environment.workdir: where Harbor's exec starts ("" : the image's WORKDIR)
    has_tests: bool = True  # False for a bare environment: nothing to evaluate


def is_harbor_task(task_dir: Path | str) -> bool:
    task_dir = Path(task_dir)
    return all((task_dir / name).is_file() for name in HARBOR_FILES)


def is_harbor_environment(task_dir: Path | str) -> bool:
    """A bare Harbor environment (an uploaded task only): environment/ and a task.toml for its
    [environment] settings, without instruction.md; runs of it take tool calls, no evaluation."""
    task_dir = Path(task_dir)
    return (
        (task_dir / "task.toml").is_file()
        and (task_dir / ENVIRONMENT_DIR).is_dir()
        and not (task_dir / "instruction.md").exists()
    )


def is_harbor_folder(task_dir: Path | str) -> bool:
    """Read as Harbor's format: a Harbor task or a bare environment, with no task.yaml (which wins)."""
    if (Path(task_dir) / "task.yaml").is_file():
        return False
    return is_harbor_task(task_dir) or is_harbor_environment(task_dir)


def compose_path(task_dir: Path | str) -> Path | None:
    """The task's environment/docker-compose.yaml (or .yml), None when it has only a Dockerfile."""
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        candidate = Path(task_dir) / ENVIRONMENT_DIR / name
        if candidate.is_file():
            return candidate
    return None


def _table(data: dict, key: str, source: Path) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise HarborTaskError(f"{source}: [{key}] must be a table, not {type(value).__name__}")
    return value


def _number(table: dict, key: str, default, source: Path, section: str):
    value = table.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HarborTaskError(f"{source}: {section}.{key} must be a positive number, not {value!r}")
    return value


def _strings(table: dict, key: str, source: Path, section: str) -> dict:
    value = table.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise HarborTaskError(f"{source}: {section}.{key} must be a table of strings")
    return dict(value)


def size_mb(text: object, source: Path, key: str) -> int:
    """Harbor's deprecated size strings ("2G", "512M", "1024K") in MB, as Harbor reads them."""
    units = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    value = str(text).strip().upper()
    try:
        mb = float(value[:-1]) * units[value[-1:]]
    except (KeyError, ValueError):
        raise HarborTaskError(f"{source}: environment.{key} must be a size like '2G' or '512M', not {text!r}") from None
    if mb <= 0:
        raise HarborTaskError(f"{source}: environment.{key} must be positive, not {text!r}")
    return int(mb)


def _memory_mb(env: dict, source: Path) -> int:
    if "memory_mb" in env:
        return int(_number(env, "memory_mb", MEMORY_MB, source, "environment"))
    if "memory" in env:  # deprecated form; Harbor maps it onto memory_mb
        return size_mb(env["memory"], source, "memory")
    return MEMORY_MB


def _storage_mb(env: dict, source: Path) -> int | None:
    if env.get("storage_mb") is not None:
        return int(_number(env, "storage_mb", None, source, "environment"))
    if isinstance(env.get("storage"), str):  # deprecated; Harbor ignores a non-string value
        return size_mb(env["storage"], source, "storage")
    return None


def _refusals(data: dict, env: dict, task_dir: Path) -> list[str]:
    """What termpool cannot honour; each a TASK_UNSUPPORTED reason."""
    problems = []
    if (task_dir / "steps").is_dir() or data.get("steps"):
        problems.append("multi-step tasks (steps/) are not supported")
    if env.get("gpus"):
        problems.append(f"environment.gpus = {env['gpus']}: termpool has no GPUs")
    if env.get("mcp_servers"):
        problems.append("environment.mcp_servers are not supported")
    if env.get("env"):
        problems.append("environment.env (variables taken from the host) is not supported")
    if env.get("healthcheck"):
        problems.append("environment.healthcheck is not supported")
    mode = env.get("network_mode")
    if mode not in (None, "public", "no-network") or env.get("allowed_hosts"):
        problems.append(f"environment.network_mode = {mode!r} with allowed hosts is not supported")
    return problems


def _instruction(task_dir: Path) -> str:
    try:
        instruction = (task_dir / "instruction.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HarborTaskError(f"{task_dir / 'instruction.md'}: cannot read it: {exc}") from None
    if not instruction.strip():
        raise HarborTaskError(f"{task_dir / 'instruction.md'}: the instruction is empty")
    return instruction


def load_harbor(task_dir: Path) -> tuple[str, dict, HarborConfig]:
    """(instruction, {max_agent_timeout_sec?}, HarborConfig) of a Harbor task folder (of a bare
    environment: no instruction, no tests)."""
    source = task_dir / "task.toml"
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise HarborTaskError(f"{source}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{source}: invalid TOML: {exc}") from None
    bare = is_harbor_environment(task_dir)
    instruction = "" if bare else _instruction(task_dir)
    verifier, agent, env = (_table(data, key, source) for key in ("verifier", "agent", "environment"))
    solution = _table(data, "solution", source)
    problems = _refusals(data, env, task_dir)
    if problems:
        raise HarborUnsupported(f"{task_dir}: " + "; ".join(problems))
    if not bare and not (task_dir / "tests" / "test.sh").is_file():
        raise HarborTaskError(f"{task_dir}: no tests/test.sh (the verifier Harbor runs)")
    compose = compose_path(task_dir)
    docker_image = env.get("docker_image") or ""
    if not isinstance(docker_image, str):
        raise HarborTaskError(f"{source}: environment.docker_image must be a string")
    has_dockerfile = (task_dir / ENVIRONMENT_DIR / "Dockerfile").is_file()
    if not has_dockerfile and not docker_image:
        raise HarborTaskError(f"{task_dir}: no environment/Dockerfile (the agent's image) and no docker_image")
    workdir = env.get("workdir") or ""
    if not isinstance(workdir, str) or workdir and not workdir.startswith("/"):
        raise HarborTaskError(f"{source}: environment.workdir must be an absolute path")
    allow_internet = env.get("allow_internet", True)
    if not isinstance(allow_internet, bool):
        raise HarborTaskError(f"{source}: environment.allow_internet must be true or false")
    user = verifier.get("user")
    config = HarborConfig(
        verifier_timeout_sec=float(_number(verifier, "timeout_sec", VERIFIER_TIMEOUT_SEC, source, "verifier")),
        verifier_env=_strings(verifier, "env", source, "verifier"),
        verifier_user="" if user is None else str(user),
        solution_env=_strings(solution, "env", source, "solution"),
        build_timeout_sec=float(_number(env, "build_timeout_sec", BUILD_TIMEOUT_SEC, source, "environment")),
        cpus=float(_number(env, "cpus", CPUS, source, "environment")),
        memory_mb=_memory_mb(env, source),
        docker_image=docker_image,
        allow_internet=allow_internet and env.get("network_mode") != "no-network",
        has_compose=compose is not None,
        has_dockerfile=has_dockerfile,
        storage_mb=_storage_mb(env, source),
        workdir=workdir,
        has_tests=not bare,
    )
    agent_timeout = _number(agent, "timeout_sec", None, source, "agent")
    timeouts = {"max_agent_timeout_sec": float(agent_timeout)} if agent_timeout else {}
    return instruction, timeouts, config


# ---- ${VAR} / ${VAR:-default} in [verifier] env and [solution] env ----------------------------
# Harbor's rule (harbor: src/harbor/utils/env.py resolve_env_vars): a value that is wholly one
# template takes the host variable, else the default, else it is an error; anything else
# (templates inside a longer value too) is literal.
TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


def resolve_env(env: Mapping[str, str], host: Mapping[str, str], allowed: frozenset | set | tuple) -> dict:
    """The env with its templates resolved. Only host variables named in `allowed` are read
    (HARBOR_ENV_ALLOWLIST: the worker's environment holds secrets, e.g. REDIS_URL and tokens,
    that a task file must not be able to copy into its container); any other resolves to its
    default, or HarborTaskError names the setting when it has none."""
    resolved = {}
    for key, value in env.items():
        match = TEMPLATE.fullmatch(value)
        if not match:
            resolved[key] = value
            continue
        name, default = match.group(1), match.group(2)
        if name in allowed and name in host:
            resolved[key] = host[name]
        elif default is not None:
            resolved[key] = default
        elif name in allowed:
            raise HarborTaskError(f"env {key}: ${{{name}}} is not set on this host and has no default")
        else:
            raise HarborTaskError(
                f"env {key}: ${{{name}}} has no default and {name} is not in HARBOR_ENV_ALLOWLIST "
                "(termpool passes only the host variables named there)"
            )
    return resolved
