"""A run's container set: task images, start, teardown and the reconcile sweep.

Every start first asks compose for the task's resolved file (environments/compose_config.py; once
per task, environments/compose_cache.py) and refuses what termpool never runs. The agent's
container is the service terminal-bench would use (compose_config.client_service). A file that
is that one plain service is then started straight through the docker SDK (one create+start, no
compose process); any other goes through `docker compose up` with a generated override
(environments/container_spec.py) that adds termpool's labels, limits and mounts (the tool server's
socket folder, the session helper read-only) to whatever the task sets. A run's teardown removes
its containers, networks and volumes (named and anonymous).
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import docker.errors
import yaml

from environments import container_spec, disk_usage, networks
from environments.compose_cache import resolve_once, resolve_run
from environments.compose_config import (
    BUILD_CLIENT_NAME,
    build_env,
    check_supported,
    client_image,
    client_service,
    compose_env,
    service_images,
    start_order,
    task_files,
)
from environments.docker_client import (
    HOST_LABEL,
    MANAGED_LABEL,
    MAX_OUTPUT,
    RUN_LABEL,
    ComposeError,
    docker_client,
    run_compose,
    termpool_labels,
)
from environments.session_helper import (
    CTL_DIR,
    CTL_SOCKET,
    boot_entrypoint,
    helper_mount,
    is_root,
    remove_helper_dir,
    session_workdir,
)
from poolcore import failures
from poolcore.config import Settings
from poolcore.failures import TaskStartFailed
from poolcore.harbor_task import ENVIRONMENT_DIR, is_harbor_folder
from poolcore.task_spec import name_prefix, one_per_host_reasons
from poolcore.uploaded_tasks import docker_task_name

CTL_MOUNT = CTL_DIR  # where the client container sees its socket folder
CTL_SOCKET_NAME = posixpath.basename(CTL_SOCKET)
LOG_LINES = 40  # last lines of a failing service's log quoted in its error


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
    booted: bool = False  # its tool server started with it (tp-session boot): nothing to prepare
    workdir: str = ""  # where its tool sessions start ("": /workspace; session_helper.session_workdir)

    def to_dict(self) -> dict:
        return asdict(self)


def run_name(task_name: str, run_id: str) -> str:
    """Container and compose project name: lowercase [a-z0-9][a-z0-9_-]+ and unique per run
    (compose refuses a dot in a project name: a task named `x.v2` runs as `x-v2-<run>`)."""
    stem = re.sub(r"[^a-z0-9_-]+", "-", task_name.lower()).strip("-_")[:40] or "task"
    return f"{stem}-{run_id}"


def load_compose(task_name: str, task_dir: Path, cfg: Settings, timeout: float) -> dict:
    """The task's resolved compose model with build-time variables (TaskInvalid when malformed)."""
    return resolve_once(
        task_dir, task_files(task_dir, cfg), name_prefix(task_name).lower(), build_env(task_name, cfg), timeout
    )


def is_template(
    compose: dict, cfg: Settings, task_dir: Path, task_name: str, client_name: str = BUILD_CLIENT_NAME
) -> bool:
    """True when the SDK can start the task's one service without compose. `client_name` is the
    client container name `compose` was resolved with: load_compose's unless told otherwise."""
    return container_spec.direct_eligible(
        compose, build_context(task_dir), client_image(task_name, cfg, task_dir), client_name
    )


def build_context(task_dir: Path) -> Path:
    """The folder the agent's image is built from: the task folder, a Harbor task's environment/."""
    return Path(task_dir) / ENVIRONMENT_DIR if is_harbor_folder(task_dir) else Path(task_dir)


@functools.lru_cache(maxsize=1)
def engine_cpus() -> float:
    """CPUs of the Docker host: docker refuses a cpus limit above it."""
    return float(docker_client().info().get("NCPU") or os.cpu_count() or 1)


# ---- start ----------------------------------------------------------------------------------
def start(
    run: dict,
    task_dir: Path,
    run_dir: Path,
    cfg: Settings,
    timeout: float,
    force_compose: bool = False,
    disk_limit: int = 0,
    images: dict | None = None,
    starter=None,
    subnets: Callable[[int], list[str]] | None = None,
):
    """Start the run's services; return (RunEnv, client container). Cleans up on failure.

    `run` needs run_id, task_key and task_meta.task_name (an uploaded task's images are named
    by its digest: uploaded_tasks.docker_task_name); a warm-pool container is started
    the same way under its warm id. force_compose starts even a fast-path task with compose.
    disk_limit (bytes, 0: none) caps each container's writable layer where the storage driver
    enforces a size (disk_usage.storage_quota); the periodic check sums the run's containers.
    `images` (a fork's child, environments/forking.py) names the image each service starts
    from instead of the task's, by compose service ("" : the one container of a fast-path task).
    `starter(containers, restart)` starts the created containers ({service: container}, in
    compose's start order) in place of a plain start: a fork's child restored from checkpoints
    (environments/checkpoints.py); `restart()` is that plain start, for when a restore fails.
    `subnets(n)` gives n blocks of the host's run-network range (CIDRs) for a compose run's
    networks, before any of them is made; None leaves the choice to Docker (builds, tools).
    A one-service run joins a termpool bridge where containers cannot reach each other
    (environments/networks.py).
    """
    images = images or {}
    quota = {"size": str(disk_limit)} if disk_limit and disk_usage.storage_quota() else None
    task_name = docker_task_name(run["task_meta"])
    name = run_name(task_name, run["run_id"])
    labels = termpool_labels(run["run_id"], cfg.host_id, run["task_key"])
    image = client_image(task_name, cfg, task_dir)

    def make_env(project: str, folder: Path) -> dict:
        return {**compose_env(task_name, project, folder, image), **cfg.proxy_env}

    env = make_env(name, run_dir)
    deadline = time.monotonic() + timeout  # one time limit for resolving and starting
    resolved = resolve_run(task_dir, task_files(task_dir, cfg), name, run_dir, make_env, timeout)
    check_supported(resolved, task_dir)
    client = client_service(resolved, name, task_dir)  # `name` is this resolution's client container name
    ctl = make_ctl_dir(cfg, run["run_id"])
    try:
        mounts = [f"{ctl}:{CTL_MOUNT}:rw", helper_mount(ctl)]
        boot = boot_server(resolved, client, task_name)
        if not force_compose and is_template(resolved, cfg, task_dir, task_name, name):
            options = container_spec.direct_options(resolved, client, cfg, mounts, engine_cpus())
            options["network"] = networks.isolated_network(cfg.isolated_bridge_size)
            if quota:
                options["storage_opt"] = quota
            container = start_direct(images.get("", image), {**options, **boot}, labels, name, starter)
            mode = "direct"
        else:
            needed = container_spec.networks_needing_subnets(resolved) if subnets else []
            override = container_spec.run_override(
                resolved,
                task_name,
                labels,
                name,
                mounts,
                cfg,
                engine_cpus(),
                client_entry=boot,
                subnets=dict(zip(needed, subnets(len(needed)))) if needed else None,
            )
            for service in override["services"].values() if quota else ():
                service["storage_opt"] = quota
            for service, committed in images.items():
                if service in override["services"]:
                    override["services"][service]["image"] = committed
            project = Project(name, task_dir, run_dir, env, start_order(resolved))
            container = _start_compose(project, override, cfg, max(1.0, deadline - time.monotonic()), starter)
            mode = "compose"
    except BaseException as exc:
        try:
            remove_run_resources(run["run_id"], name)
        finally:  # the engine away (a restart): the socket folder goes still; the reconcile sweeps the rest
            remove_ctl_dir(str(ctl))
        _raise_if_held(exc, task_dir, task_name)
        raise
    user = ((container.attrs or {}).get("Config") or {}).get("User") or ""
    workdir = session_workdir(task_dir, container)
    env = RunEnv(
        mode, name, container.name, str(run_dir), ctl_dir=str(ctl), user=user, booted=bool(boot), workdir=workdir
    )
    return env, container


# What Docker says when a pinned subnet, address or host port is taken on this daemon.
HELD_SIGNS = ("Pool overlaps", "port is already allocated", "address already in use", "Address already in use")


def _raise_if_held(exc: BaseException, task_dir: Path, task_name: str) -> None:
    """A task that allows one live run per host, started where another run of it (allocated
    under another task key, so placement could not tell) holds what it pins: 429, not a 500."""
    reasons = one_per_host_reasons(task_dir)
    if reasons and any(sign in f"{exc} {getattr(exc, 'output', '')}" for sign in HELD_SIGNS):
        raise failures.HeldOnThisHost(
            f"task {task_name!r} allows one live run per host ({'; '.join(reasons)}), and another run of it"
            " holds it on this host; close that run or allocate under the task's own name"
        ) from exc


def boot_server(resolved: dict, client: str, task_name: str) -> dict:
    """The client's entrypoint and command when it runs as root: tp-session boot starts the
    tool server, then becomes the container's own command, exactly as Docker would have run
    it. One docker exec less per start, and the server listens before the task's command
    runs. Empty for another user, whose folders only an exec as root can make."""
    svc = resolved["services"][client]
    image = service_images(task_name, resolved).get(client) or svc.get("image")
    config = docker_client().api.inspect_image(image).get("Config") or {}
    own = container_spec.unescaped({k: svc.get(k) for k in ("command", "entrypoint", "user")})
    command = container_spec.own_command(own, config)
    if not command or not is_root(own["user"] or config.get("User") or ""):
        return {}
    return {"entrypoint": boot_entrypoint(), "command": command}


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
    """The run's socket folder and, beside it, the folder its helper is mounted from."""
    if path:
        shutil.rmtree(path, ignore_errors=True)
        remove_helper_dir(path)


def warm_capable(task_dir: Path, cfg: Settings, task_name: str | None = None) -> bool:
    """Only fast-path tasks are pre-started: their container needs nothing run-specific."""
    if cfg.warm_pool_size <= 0:
        return False
    task_name = task_name or Path(task_dir).name
    return is_template(load_compose(task_name, task_dir, cfg, cfg.timeouts.reset_session), cfg, task_dir, task_name)


def client_if_running(name: str):
    """The named container when it exists and runs, else None (a warm one that died)."""
    try:
        container = docker_client().containers.get(name)
    except docker.errors.NotFound:
        return None
    return container if container.status == "running" else None


def start_direct(image: str, options: dict, labels: dict, name: str, starter=None):
    # create + start, not run(): run() would try to pull a missing image from a registry.
    container = docker_client().containers.create(image, name=name, labels=labels, **options)
    if starter:
        starter({"": container}, container.start)
    else:
        container.start()
    container.reload()
    _raise_if_failed([container], "", name)
    return container


def compose_files(task_dir: Path, cfg: Settings, override: dict, run_dir: Path) -> list[str]:
    path = run_dir / "termpool-compose.override.yaml"
    path.write_text(yaml.safe_dump(override))
    return task_files(task_dir, cfg) + ["-f", str(path)]


@dataclass
class Project:
    """A run's compose project: its name (= the client container's), task and run folders,
    compose variables and services in start order."""

    name: str
    task_dir: Path
    run_dir: Path
    env: dict
    order: list


def _start_compose(project: Project, override: dict, cfg: Settings, timeout: float, starter=None):
    name, task_dir = project.name, project.task_dir
    files = compose_files(task_dir, cfg, override, project.run_dir)
    deadline = time.monotonic() + timeout

    def up(*how: str) -> None:
        left = max(1.0, deadline - time.monotonic())
        run_compose(["-p", name, *files, "up", *how, "--no-build", "--pull", "never"], project.env, left, task_dir)

    stderr = ""
    try:
        if starter is None:
            up("-d")
        else:  # created only; the starter starts them (a fallback recreates them all afresh)
            up("--no-start")
            starter(_by_service(name, project.order), lambda: up("-d", "--force-recreate"))
    except (ComposeError, TimeoutError) as exc:
        stderr = getattr(exc, "stderr_tail", "") or str(exc)
        _raise_if_failed(_project_containers(name), stderr, name)
        raise
    _raise_if_failed(_project_containers(name), stderr, name)
    return docker_client().containers.get(name)


def _by_service(project: str, order: list) -> dict:
    """The project's containers by service, in start order."""
    found = {c.labels.get("com.docker.compose.service", c.name): c for c in _project_containers(project)}
    rank = {service: i for i, service in enumerate(order)}
    return dict(sorted(found.items(), key=lambda item: rank.get(item[0], len(rank))))


def _project_containers(project: str) -> list:
    return docker_client().containers.list(
        all=True, filters={"label": f"com.docker.compose.project={project}"}, ignore_removed=True
    )


def _raise_if_failed(containers: list, stderr: str, client: str) -> None:
    """TaskStartFailed naming the first service that failed: the client not running, another
    service exited non-zero or died, or one unhealthy (or still starting when `up` failed).
    A one-shot service that exited 0 is fine."""
    for container in sorted(containers, key=lambda c: c.name == client):  # the cause before the client
        state = container.attrs.get("State") or {}
        health = (state.get("Health") or {}).get("Status", "")
        stopped = state.get("Status") in ("exited", "dead", "created")
        failed = (
            (stopped and (container.name == client or state.get("ExitCode", 0) != 0 or state["Status"] == "dead"))
            or health == "unhealthy"
            or (stderr and health == "starting")
        )
        if failed:
            service = container.labels.get("com.docker.compose.service") or container.name
            what = f"health {health}" if health in ("unhealthy", "starting") else f"exit code {state.get('ExitCode')}"
            logs = container.logs(tail=LOG_LINES).decode(errors="replace")[-MAX_OUTPUT:]
            text = "\n".join(part for part in (stderr[-MAX_OUTPUT:], f"service {service!r} logs:\n{logs}") if part)
            raise TaskStartFailed(f"service {service!r} failed to start ({what})\n{text}", output=text)


# ---- teardown -------------------------------------------------------------------------------
def remove_run_resources(run_id: str, project: str = "", containers_only: bool = False) -> int:
    """Remove every container, network and volume of a run (found by labels); return containers
    removed. Anonymous volumes (an image's VOLUME, a service's `- /path`) go with their container
    (`v=True`); named ones carry the run's labels (container_spec.run_override). A run known to
    have been started without compose (`containers_only`) has no network or volume of its own,
    so nobody lists them: two Docker calls less per teardown."""
    client = docker_client()
    removed = 0
    found = client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run_id}"}, sparse=True)
    for container in found:  # sparse: ids from the list, no inspect per container
        try:
            container.remove(force=True, v=True)
            removed += 1
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409 or "already in progress" not in str(exc):
                raise
            _wait_removed(client, container.id)  # a teardown and a failed start's cleanup, say
    if containers_only:
        return removed
    filters = [{"label": f"{RUN_LABEL}={run_id}"}]
    if project:
        filters.append({"label": f"com.docker.compose.project={project}"})
    for flt in filters:
        for network in client.networks.list(filters=flt):
            try:
                network.remove()
            except docker.errors.NotFound:
                pass
    for flt in filters:
        for volume in client.volumes.list(filters=flt):
            _remove_volume(volume)
    return removed


def _remove_volume(volume) -> None:
    try:
        volume.remove()
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        # In use: by a container of the run another caller is still removing, say. The
        # reconcile sweep finds it again by its labels once the run is gone.
        if exc.status_code != 409:
            raise


def _wait_removed(client, container_id: str, limit: float = 60.0) -> None:
    """Wait for another caller's removal of the container to end (its networks go next)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            client.containers.get(container_id)
        except docker.errors.NotFound:
            return
        time.sleep(0.1)
    raise TimeoutError(f"container {container_id[:12]} was still being removed after {limit:.0f} s")


def host_containers(host: str) -> list:
    """This host's termpool containers that are running."""
    mine = {"label": [f"{HOST_LABEL}={host}", MANAGED_LABEL]}
    return docker_client().containers.list(filters=mine, ignore_removed=True)


def running_containers(host: str) -> set[str]:
    """Names of this host's termpool containers that are running."""
    return {c.name for c in host_containers(host)}


def is_running(name: str) -> bool:
    """The container exists and runs, asked now."""
    try:
        return docker_client().containers.get(name).status == "running"
    except docker.errors.NotFound:
        return False


def reconcile(host: str, is_live, socket_dir: Path | None = None) -> list[str]:
    """Remove termpool containers, networks and volumes of this host whose run no longer exists."""
    client = docker_client()
    orphans = set()
    mine = {"label": [f"{HOST_LABEL}={host}", MANAGED_LABEL]}
    for container in client.api.containers(all=True, filters=mine):  # the listing's labels: no inspect each
        run_id = (container.get("Labels") or {}).get(RUN_LABEL, "")
        if not is_live(run_id):
            orphans.add(run_id)
    for item in [*client.networks.list(filters=mine), *client.volumes.list(filters=mine)]:
        run_id = (item.attrs.get("Labels") or {}).get(RUN_LABEL, "")
        if not is_live(run_id):
            orphans.add(run_id)
    for run_id in orphans:
        remove_run_resources(run_id)
        if socket_dir is not None and run_id:
            remove_ctl_dir(str(socket_dir / run_id))
    return sorted(orphans)
