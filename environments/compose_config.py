"""A task's compose file as compose itself resolves it, and what termpool refuses in it.

Compose does all the reading: `docker compose config --format json` with termpool's variables
interpolates `${VAR:-default}` / `${VAR:?message}`, merges env_file into environment, makes
paths absolute and normalises every short form. termpool reads only that resolved form, both
when it starts a run and in `dataset check` (one set of rules for both).
"""

from __future__ import annotations

import graphlib
import json
import posixpath
import secrets
from pathlib import Path

from environments import harbor_compose
from environments.docker_client import ComposeError, run_compose
from poolcore.config import Settings
from poolcore.failures import TaskInvalid, TaskUnsupported
from poolcore.harbor_task import is_harbor_folder
from poolcore.task_spec import TaskError, Unsupported, compose_file, image_name, load_task_cached, name_prefix

CLIENT_SERVICE = "client"  # the agent's service when none has the client container name
CLIENT_NAME_VAR = "T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME"
# The client container name in builds and checks, where no run exists. Random per process, so
# no task file can name it: the client is the service whose container_name resolved to it.
BUILD_CLIENT_NAME = "tpclient" + secrets.token_hex(8)
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock")
# Capabilities that let a container reach past its namespaces (mounts, modules, raw devices,
# the host clock, reading any host file by handle, LSM policy, BPF programs).
REFUSED_CAPS = {
    "ALL",
    "SYS_ADMIN",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_BOOT",
    "SYS_TIME",
    "DAC_READ_SEARCH",
    "MAC_ADMIN",
    "MAC_OVERRIDE",
    "BPF",
}
# Namespace settings whose value may be "host" (or another container's): never for a task.
SHARED_NAMESPACES = ("network_mode", "pid", "ipc", "uts", "userns_mode", "cgroup")


def client_image(task_name: str, cfg: Settings, task_dir: Path | None = None) -> str:
    """The agent's image: built as tb__<task>__client, or pulled as TBENCH_DOCKER_PULL_PREFIX +
    task name; in pull mode a Harbor task's own docker_image when it names one."""
    if cfg.image_source != "pull":
        return image_name(task_name)
    harbor = _harbor_config(task_dir) if task_dir is not None else None
    return harbor.docker_image if harbor and harbor.docker_image else cfg.pull_prefix + task_name


def _harbor_config(task_dir: Path):
    """The task's HarborConfig, None for the original format (or a task that does not load:
    its start says why)."""
    if not is_harbor_folder(task_dir):
        return None
    try:
        return load_task_cached(task_dir).harbor
    except TaskError:
        return None


def compose_env(task_name: str, container: str, run_dir: Path, client_image: str) -> dict:
    """The variables a task's compose file may use (docs/task-format.md)."""
    return {
        "T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME": client_image,
        CLIENT_NAME_VAR: container,
        "T_BENCH_TASK_DOCKER_NAME_PREFIX": name_prefix(task_name),
        "T_BENCH_TEST_DIR": "/tests",
        "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
        "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs",
        "T_BENCH_TASK_LOGS_PATH": str(run_dir / "sessions"),
        "T_BENCH_TASK_AGENT_LOGS_PATH": str(run_dir / "agent-logs"),
    }


NO_RUN_DIR = Path("/nonexistent/termpool-run")  # the run folder in builds and checks: no run exists


def build_env(task_name: str, cfg: Settings) -> dict:
    """The variables for builds and checks, with placeholders for the run's name and folder."""
    return {**compose_env(task_name, BUILD_CLIENT_NAME, NO_RUN_DIR, client_image(task_name, cfg)), **cfg.proxy_env}


def task_files(task_dir: Path, cfg: Settings) -> list[str]:
    """The task's compose file and the operator's COMPOSE_OVERRIDE_PATH, as `-f` arguments (a
    Harbor task's: environments/harbor_compose.py)."""
    try:
        if is_harbor_folder(task_dir):
            harbor = load_task_cached(task_dir).harbor
            if cfg.image_source != "pull" and not harbor.has_dockerfile:
                raise TaskUnsupported(
                    f"{task_dir}: environment.docker_image {harbor.docker_image!r} and no environment/Dockerfile:"
                    " this pool builds images (TBENCH_DOCKER_IMAGE_SOURCE=build); serve it from a pool that pulls"
                )
            files = harbor_compose.task_files(task_dir, harbor, build=cfg.image_source != "pull")
        else:
            files = ["-f", str(compose_file(Path(task_dir).resolve()))]
    except Unsupported as exc:
        raise TaskUnsupported(str(exc)) from None
    except TaskError as exc:
        raise TaskInvalid(str(exc)) from None
    if cfg.compose_override_path:
        files += ["-f", cfg.compose_override_path]
    return files


def resolve(task_dir: Path, files: list[str], project: str, env: dict, timeout: float) -> dict:
    """The compose model after interpolation and merging; TaskInvalid when compose rejects it."""
    config = ["-p", project, *files, "config", "--format", "json"]
    try:
        out = run_compose(config, env, timeout, task_dir)
    except ComposeError as exc:
        shared = _shared_names(config, env, timeout, task_dir) if "already in use by service" in exc.stderr_tail else ""
        raise TaskInvalid(f"{files[1]}: {shared or exc.stderr_tail}", output=exc.stderr_tail) from None
    resolved = json.loads(out)
    if not resolved.get("services"):
        raise TaskInvalid(f"{files[1]}: the compose file has no services")
    return resolved


def _shared_names(config: list[str], env: dict, timeout: float, task_dir: Path) -> str:
    """Which services share a container_name, when compose refused the file for it: its own
    message names only one of them. "" when that cannot be told."""
    try:
        services = json.loads(run_compose([*config, "--no-consistency"], env, timeout, task_dir))["services"]
    except (ComposeError, TimeoutError, ValueError, KeyError):
        return ""
    by_name: dict[str, list[str]] = {}
    for name, svc in services.items():
        if svc.get("container_name"):
            by_name.setdefault(svc["container_name"], []).append(name)
    shared = [(value, names) for value, names in by_name.items() if len(names) > 1]
    if not shared:
        return ""
    value, names = shared[0]
    if value == env.get(CLIENT_NAME_VAR):
        return _ambiguous(names)
    return f"services {_listed(names)} all set container_name {value!r}; a container name is one service's"


def _listed(names) -> str:
    return ", ".join(repr(name) for name in names)


def _ambiguous(names: list[str]) -> str:
    return (
        f"services {_listed(names)} all set container_name: ${{{CLIENT_NAME_VAR}}}; "
        "the agent's container must be exactly one service"
    )


# ---- the agent's service --------------------------------------------------------------------
def client_candidates(resolved: dict, client_name: str) -> list[str]:
    """The services that may be the agent's, as terminal-bench finds it: those whose
    container_name resolved to `client_name` (the value this resolution passed for
    T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME), else the service named `client`."""
    services = resolved["services"]
    named = [name for name, svc in services.items() if svc.get("container_name") == client_name]
    return named or ([CLIENT_SERVICE] if CLIENT_SERVICE in services else [])


def client_problem(resolved: dict, client_name: str) -> str:
    """Why no single service is the agent's ("" when one is)."""
    candidates = client_candidates(resolved, client_name)
    if len(candidates) > 1:
        return _ambiguous(candidates)
    if candidates:
        return ""
    return (
        f"no service for the agent's container: none sets container_name: ${{{CLIENT_NAME_VAR}}} "
        f"and none is named {CLIENT_SERVICE!r} (services: {_listed(resolved['services'])})"
    )


def client_service(resolved: dict, client_name: str, task_dir: Path | None = None) -> str:
    """The agent's service (client_candidates); TaskInvalid naming the services (and the task's
    compose file, given its folder) when there is not exactly one."""
    problem = client_problem(resolved, client_name)
    if problem and task_dir:
        try:
            problem = f"{compose_file(Path(task_dir).resolve())}: {problem}"
        except TaskError:  # a Harbor task without a compose file of its own
            problem = f"{task_dir}: {problem}"
    if problem:
        raise TaskInvalid(problem)
    return client_candidates(resolved, client_name)[0]


def start_order(resolved: dict) -> list[str]:
    """The services in compose's start order: each after those it depends on (depends_on)."""
    graph = {name: list(svc.get("depends_on") or ()) for name, svc in resolved["services"].items()}
    return list(graphlib.TopologicalSorter(graph).static_order())


def service_images(task_name: str, resolved: dict) -> dict:
    """Stable image names for services that build without naming an image, so one build per
    host serves every run's compose project."""
    prefix = name_prefix(task_name).lower()
    return {
        name: f"{prefix}__{name}".lower()
        for name, svc in resolved["services"].items()
        if "build" in svc and not svc.get("image")
    }


# ---- what termpool refuses ------------------------------------------------------------------
def unsupported(resolved: dict, task_dir: Path) -> list[str]:
    """Everything in the resolved model that would give a task power over the host or over
    other runs; empty when termpool can run it."""
    problems = []
    for name, svc in resolved["services"].items():
        where = f"service {name!r}"
        if svc.get("privileged"):
            problems.append(f"{where} asks to be privileged; termpool never runs privileged containers")
        caps = {c.upper().removeprefix("CAP_") for c in svc.get("cap_add") or []}
        if caps & REFUSED_CAPS:
            problems.append(f"{where} asks for capability {', '.join(sorted(caps & REFUSED_CAPS))}; refused")
        for key in SHARED_NAMESPACES:
            value = str(svc.get(key) or "")
            if value == "host" or value.startswith("container:"):
                problems.append(
                    f"{where} sets {key}: {value}; a task may not share the host's or another container's namespace"
                )
        if svc.get("devices") or svc.get("device_cgroup_rules"):
            problems.append(f"{where} asks for host devices; refused")
        if any("unconfined" in str(opt) for opt in svc.get("security_opt") or []):
            problems.append(f"{where} turns off seccomp/AppArmor confinement (security_opt); refused")
        problems += [
            f"{where} mounts {source}: task containers may not mount the Docker socket"
            for source in _socket_mounts(svc.get("volumes") or [])
        ]
        problems += _build_context_problems(where, svc.get("build"), task_dir)
    for key, volume in (resolved.get("volumes") or {}).items():
        if volume.get("external"):  # another run's (or the host's) volume, outside any teardown
            problems.append(f"volume {key!r} is external: a task may only use its own volumes")
    for key, net in (resolved.get("networks") or {}).items():
        if net.get("external"):
            problems.append(f"network {key!r} is external: a task may only use its own networks")
        # Containment's packet filter (environments/containment.py) knows task networks by Docker's bridge names.
        if (net.get("driver") or "bridge") != "bridge":
            problems.append(f"network {key!r} uses driver {net['driver']!r}; only bridge networks")
        if "com.docker.network.bridge.name" in (net.get("driver_opts") or {}):
            problems.append(f"network {key!r} names its bridge; termpool's packet filter needs Docker's own names")
    return problems


def _socket_mounts(volumes: list) -> list[str]:
    """Bind sources that are the Docker socket or a folder holding it."""
    found = []
    for volume in volumes:
        source = volume.get("source", "") if isinstance(volume, dict) else str(volume).split(":", 1)[0]
        if not source or (isinstance(volume, dict) and volume.get("type") not in (None, "bind")):
            continue
        path = posixpath.normpath(source)
        if "docker.sock" in path or any(
            sock == path or sock.startswith(path.rstrip("/") + "/") for sock in DOCKER_SOCKETS
        ):
            found.append(source)
    return found


def _build_context_problems(where: str, build, task_dir: Path) -> list[str]:
    context = build.get("context", "") if isinstance(build, dict) else ""
    if not context or "://" in context or context.startswith("git@"):
        return []
    if _outside(Path(context).resolve(), (Path(task_dir).resolve(),)):
        return [f"{where} builds from {context}, outside the task directory; refused"]
    return []


def _outside(path: Path, roots: tuple) -> bool:
    return not any(path == root or root in path.parents for root in roots)


def check_supported(resolved: dict, task_dir: Path) -> None:
    problems = unsupported(resolved, task_dir)
    if problems:
        raise TaskUnsupported(f"{task_dir}: " + "; ".join(problems))


def check_only_problems(resolved: dict, task_dir: Path) -> list[str]:
    """What termpool runs but `dataset check` points out: host paths outside the task and run
    folders that a service would see, and what two live runs of a task cannot share (fixed
    container and network names termpool makes run-specific; a published host port, which
    placement keeps to one live run of the task per host but which the rest of the host shares)."""
    problems = []
    inside = (Path(task_dir).resolve(), NO_RUN_DIR)
    for name, svc in resolved["services"].items():
        for volume in svc.get("volumes") or []:
            source = Path(volume.get("source") or "/")
            if volume.get("type") == "bind" and _outside(source, inside):
                problems.append(
                    f"service {name!r} bind-mounts the host path {source}, outside the task and run folders"
                )
        for port in svc.get("ports") or []:
            if isinstance(port, dict) and port.get("published"):
                problems.append(
                    f"service {name!r} publishes host port {port['published']}: reachable from outside "
                    "the host, and taken from every other task and service there"
                )
    for kind in ("secrets", "configs"):
        for key, item in (resolved.get(kind) or {}).items():
            source = Path(item.get("file") or task_dir)
            if _outside(source, inside):
                problems.append(f"{kind[:-1]} {key!r} reads the host file {source}, outside the task folder")
    return problems
