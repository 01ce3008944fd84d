"""A run's container set: task images, start, teardown and the reconcile sweep.

Tasks whose compose file is the standard one-service template are started straight through
the docker SDK (one create+start, no compose process); any other compose file goes through
the `docker compose` CLI with a generated override that adds termpool's labels and limits.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import docker.errors
import redis
import yaml

from tasks import containment
from tasks.docker_env import (HOST_LABEL, MANAGED_LABEL, RUN_LABEL, docker_client, run_compose,
                              termpool_labels)
from tasks.session_helper import CTL_DIR, CTL_SOCKET
from termpool.config import Settings
from termpool.task_spec import compose_file, image_name, name_prefix

CLIENT_SERVICE = "client"
CTL_MOUNT = CTL_DIR  # where the client container sees its socket folder
CTL_SOCKET_NAME = posixpath.basename(CTL_SOCKET)
_TEMPLATE_SERVICE_KEYS = {"build", "image", "container_name", "command", "environment", "volumes"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
DOCKER_SOCKET = "docker.sock"


@dataclass
class RunEnv:
    """What a worker needs to find a run's containers again (kept in the run record)."""

    mode: str  # "direct" or "compose"
    project: str
    client: str  # client container name
    run_dir: str
    warm_id: str = ""  # set when the client came from the warm pool (its labels name this id)
    ctl_dir: str = ""  # host folder mounted at CTL_MOUNT: the in-container tool server's socket
    user: str = ""  # the client container's configured user


    def to_dict(self) -> dict:
        return asdict(self)


def run_name(task_name: str, run_id: str) -> str:
    """Container and compose project name: lowercase [a-z0-9][a-z0-9_.-]+ and unique per run."""
    stem = re.sub(r"[^a-z0-9_.-]+", "-", task_name.lower()).strip("-_.")[:40] or "task"
    return f"{stem}-{run_id}"


def compose_env(task_name: str, container: str, run_dir: Path, client_image: str) -> dict:
    return {
        "T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME": client_image,
        "T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME": container,
        "T_BENCH_TASK_DOCKER_NAME_PREFIX": name_prefix(task_name),
        "T_BENCH_TEST_DIR": "/tests",
        "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
        "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs",
        "T_BENCH_TASK_LOGS_PATH": str(run_dir / "sessions"),
        "T_BENCH_TASK_AGENT_LOGS_PATH": str(run_dir / "agent-logs"),
    }


def load_compose(task_dir: Path) -> dict:
    path = compose_file(task_dir)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict) or not data["services"]:
        raise ValueError(f"{path.name} has no services")
    return data


def is_template(compose: dict, cfg: Settings) -> bool:
    """True for the standard one-service layout that the SDK can start without compose."""
    services = compose["services"]
    if cfg.compose_override_path or set(compose) - {"services", "version"} or list(services) != [CLIENT_SERVICE]:
        return False
    service = services[CLIENT_SERVICE]
    build = service.get("build", {})
    return (isinstance(service, dict) and set(service) <= _TEMPLATE_SERVICE_KEYS
            and (build in (".", "./") or (isinstance(build, dict) and set(build) <= {"dockerfile", "context"}
                                          and build.get("context", ".") in (".", "./"))))


def client_image(task_name: str, cfg: Settings) -> str:
    return cfg.pull_prefix + task_name if cfg.image_source == "pull" else image_name(task_name)


def service_images(task_name: str, compose: dict) -> dict:
    """Stable image names for services that build without naming an image, so one build per
    host serves every run's compose project."""
    prefix = name_prefix(task_name).lower()
    return {name: f"{prefix}__{name}".lower() for name, svc in compose["services"].items()
            if isinstance(svc, dict) and "build" in svc and "image" not in svc}


# ---- images ---------------------------------------------------------------------------------
def ensure_image(task_name: str, task_dir: Path, cfg: Settings, timeout: float, locks: redis.Redis) -> str:
    """Build (or pull) the task's images once per host; concurrent callers wait for that one."""
    compose = load_compose(task_dir)
    image = client_image(task_name, cfg)
    if cfg.image_source == "pull":
        _pull_if_absent(image, timeout)
        return image
    needed = [image] if is_template(compose, cfg) else built_images(task_name, compose, cfg)
    if all(_image_exists(i) for i in needed):
        return image
    lock = locks.lock(f"tp:build-lock:{cfg.host_id}:{image}", timeout=timeout + 60, blocking_timeout=timeout)
    if not lock.acquire():
        raise TimeoutError(f"waited {timeout:g} s for another build of {image}")
    try:
        if all(_image_exists(i) for i in needed):  # built by whoever held the lock
            return image
        if is_template(compose, cfg):
            _build_with_sdk(task_dir, compose, image, cfg, timeout)
        else:
            _build_with_compose(task_name, task_dir, compose, image, cfg, timeout)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:
            pass
    return image


def built_images(task_name: str, compose: dict, cfg: Settings) -> list[str]:
    """Every image a compose build produces (client first), with variables substituted."""
    env = compose_env(task_name, "build", Path("/nonexistent"), client_image(task_name, cfg))
    generated = service_images(task_name, compose)
    images = [client_image(task_name, cfg)]
    for name, svc in compose["services"].items():
        if isinstance(svc, dict) and "build" in svc:
            images.append(generated.get(name) or _substitute(str(svc.get("image", "")), env))
    return list(dict.fromkeys(i for i in images if i))


def _image_exists(image: str) -> bool:
    try:
        docker_client().images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def _pull_if_absent(image: str, timeout: float) -> None:
    if _image_exists(image):
        return
    try:
        docker_client().images.pull(image)
    except docker.errors.APIError as exc:
        raise RuntimeError(f"image {image} is not on this host and could not be pulled: {exc.explanation or exc}")


def _build_with_sdk(task_dir: Path, compose: dict, image: str, cfg: Settings, timeout: float) -> None:
    build = compose["services"][CLIENT_SERVICE].get("build", {})
    dockerfile = build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
    deadline = time.monotonic() + timeout
    log = []
    stream = docker_client().api.build(path=str(task_dir), dockerfile=dockerfile, tag=image, rm=True, forcerm=True,
                                       buildargs=dict(cfg.proxy_env), decode=True, timeout=timeout)
    for chunk in stream:
        log.append(chunk.get("stream") or chunk.get("status") or "")
        if "error" in chunk:
            raise RuntimeError(f"building {image} failed: {chunk['error'].strip()}\n{''.join(log)[-1500:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"building {image} did not finish within {timeout:g} s")


def _build_with_compose(task_name: str, task_dir: Path, compose: dict, image: str, cfg: Settings,
                        timeout: float) -> None:
    with tempfile.TemporaryDirectory(prefix="termpool-build-") as tmp:
        run_dir = Path(tmp)
        env = {**compose_env(task_name, "build", run_dir, image), **cfg.proxy_env}
        files = _compose_files(task_dir, cfg, _override(task_name, compose, {}, "", cfg), run_dir)
        run_compose(["-p", name_prefix(task_name).lower(), *files, "build"], env, timeout, task_dir)


# ---- start ----------------------------------------------------------------------------------
def start(run: dict, task_dir: Path, run_dir: Path, cfg: Settings, timeout: float):
    """Start the run's services; return (RunEnv, client container). Cleans up on failure.

    `run` needs run_id, task_key and task_meta.task_name; a warm-pool container is started
    the same way under its warm id.
    """
    task_name = run["task_meta"]["task_name"]
    compose = load_compose(task_dir)
    name = run_name(task_name, run["run_id"])
    labels = termpool_labels(run["run_id"], cfg.host_id, run["task_key"])
    env = compose_env(task_name, name, run_dir, client_image(task_name, cfg))
    ctl = make_ctl_dir(cfg, run["run_id"])
    try:
        if is_template(compose, cfg):
            container = _start_direct(compose["services"][CLIENT_SERVICE], env, labels, name, ctl, cfg)
            mode = "direct"
        else:
            container = _start_compose(task_name, task_dir, compose, env, labels, name, ctl, run_dir, cfg, timeout)
            mode = "compose"
    except BaseException:
        remove_run_resources(run["run_id"], name)
        remove_ctl_dir(str(ctl))
        raise
    user = ((container.attrs or {}).get("Config") or {}).get("User") or ""
    return RunEnv(mode, name, container.name, str(run_dir), ctl_dir=str(ctl), user=user), container


def ctl_socket(env: dict) -> str:
    """Host path of the run's tool-server socket ("" for runs started without one)."""
    return f"{env['ctl_dir']}/{CTL_SOCKET_NAME}" if env.get("ctl_dir") else ""


def make_ctl_dir(cfg: Settings, owner_id: str) -> Path:
    """The host side of the tool server's socket folder; any container user may create the socket."""
    path = cfg.socket_dir / owner_id
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o1777)  # sticky: one container user cannot remove another's socket
    return path


def remove_ctl_dir(path: str) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def warm_capable(task_dir: Path, cfg: Settings) -> bool:
    """Only one-service template tasks are pre-started: their container needs nothing run-specific."""
    return cfg.warm_pool_size > 0 and is_template(load_compose(task_dir), cfg)


def client_if_running(name: str):
    """The named container when it exists and runs, else None (a warm one that died)."""
    try:
        container = docker_client().containers.get(name)
    except docker.errors.NotFound:
        return None
    return container if container.status == "running" else None


def _substitute(value, env: dict):
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)
    if isinstance(value, list):
        return [_substitute(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, env) for k, v in value.items()}
    return value


def _start_direct(service: dict, env: dict, labels: dict, name: str, ctl: Path, cfg: Settings):
    service = _substitute(service, env)
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    volumes = [v for v in service.get("volumes") or [] if isinstance(v, str)]
    check_volumes(volumes)
    volumes.append(f"{ctl}:{CTL_MOUNT}")
    command = service.get("command")
    # create + start, not run(): run() would try to pull a missing image from a registry.
    container = docker_client().containers.create(
        env["T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME"], command=command, name=name,
        environment={**cfg.proxy_env, **environment}, volumes=volumes, labels=labels,
        mem_limit=cfg.container_memory_limit, memswap_limit=cfg.container_memory_limit,
        privileged=False, init=True)
    container.start()
    return container


def _override(task_name: str, compose: dict, labels: dict, name: str, cfg: Settings, ctl: Path | None = None) -> dict:
    services = {}
    images = service_images(task_name, compose)
    for svc in compose["services"]:
        entry = {"labels": labels} if labels else {}
        if svc in images:
            entry["image"] = images[svc]
        services[svc] = entry
    if name:
        client = client_service(compose)
        services[client].update(container_name=name, mem_limit=cfg.container_memory_limit,
                                memswap_limit=cfg.container_memory_limit, init=True)
        if ctl is not None:
            services[client]["volumes"] = [f"{ctl}:{CTL_MOUNT}"]
    override = {"services": services}
    if labels:
        override["networks"] = {"default": {"labels": labels}}
    return override


def _compose_files(task_dir: Path, cfg: Settings, override: dict, run_dir: Path) -> list[str]:
    path = run_dir / "termpool-compose.override.yaml"
    path.write_text(yaml.safe_dump(override))
    files = ["-f", str(compose_file(task_dir))]
    if cfg.compose_override_path:
        files += ["-f", cfg.compose_override_path]
    return files + ["-f", str(path)]


def client_service(compose: dict) -> str:
    return CLIENT_SERVICE if CLIENT_SERVICE in compose["services"] else next(iter(compose["services"]))


def _start_compose(task_name, task_dir, compose, env, labels, name, ctl, run_dir, cfg, timeout):
    files = _compose_files(task_dir, cfg, _override(task_name, compose, labels, name, cfg, ctl), run_dir)
    env = {**env, **cfg.proxy_env}
    resolved = json.loads(run_compose(["-p", name, *files, "config", "--format", "json"], env, timeout, task_dir))
    check_compose_safety(resolved)
    run_compose(["-p", name, *files, "up", "-d", "--no-build", "--pull", "never"], env, timeout, task_dir)
    return docker_client().containers.get(name)


def check_volumes(volumes: list) -> None:
    for volume in volumes:
        source = volume.get("source", "") if isinstance(volume, dict) else str(volume).split(":", 1)[0]
        if DOCKER_SOCKET in source:
            raise PermissionError("task containers may not mount the Docker socket")


def check_compose_safety(resolved: dict) -> None:
    """Refuse compose files that would give a task container power over the host."""
    for name, service in (resolved.get("services") or {}).items():
        if service.get("privileged"):
            raise PermissionError(f"service {name!r} asks to be privileged; termpool never runs privileged containers")
        caps = {c.upper() for c in service.get("cap_add") or []}
        if caps & {"ALL", "SYS_ADMIN", "CAP_SYS_ADMIN"}:
            raise PermissionError(f"service {name!r} asks for capability {sorted(caps)}; refused")
        check_volumes(service.get("volumes") or [])
    containment.check_task_networks(resolved)  # (tasks/containment.py)


# ---- teardown -------------------------------------------------------------------------------
def remove_run_resources(run_id: str, project: str = "") -> int:
    """Remove every container and network of a run (found by labels); return containers removed."""
    client = docker_client()
    removed = 0
    for container in client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"}):
        try:
            container.remove(force=True, v=True)
            removed += 1
        except docker.errors.NotFound:
            pass
    filters = [{"label": f"{RUN_LABEL}={run_id}"}]
    if project:
        filters.append({"label": f"com.docker.compose.project={project}"})
    for flt in filters:
        for network in client.networks.list(filters=flt):
            try:
                network.remove()
            except docker.errors.NotFound:
                pass
    return removed


def reconcile(host: str, is_live, socket_dir: Path | None = None) -> list[str]:
    """Remove termpool containers and networks of this host whose run no longer exists."""
    client = docker_client()
    orphans = set()
    for container in client.containers.list(all=True, filters={"label": [f"{HOST_LABEL}={host}", MANAGED_LABEL]}):
        run_id = container.labels.get(RUN_LABEL, "")
        if not is_live(run_id):
            orphans.add(run_id)
    for network in client.networks.list(filters={"label": [f"{HOST_LABEL}={host}", MANAGED_LABEL]}):
        run_id = network.attrs.get("Labels", {}).get(RUN_LABEL, "")
        if not is_live(run_id):
            orphans.add(run_id)
    for run_id in orphans:
        remove_run_resources(run_id)
        if socket_dir is not None and run_id:
            remove_ctl_dir(str(socket_dir / run_id))
    return sorted(orphans)
