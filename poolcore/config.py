"""Every setting termpool reads, from the environment, in one place (see docs/settings.md)."""

from __future__ import annotations

import functools
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from poolcore.subnets import SubnetRange, parse
from poolcore.task_archive import Limits
from poolcore.tenants import Tenants
from poolcore.tenants import load as load_tenants


def _int(env, name: str, default: int, minimum: int | None = None) -> int:
    raw = env.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")
    return value


def _nice(env, name: str, default: int) -> int:
    value = _int(env, name, default, minimum=-20)
    if value > 19:
        raise ValueError(f"{name} must be at most 19, not {value}")
    return value


def _float(env, name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None


_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _bytes(env, name: str, default: str) -> int:
    """A size as docker writes one: a number with an optional b, k, m, g or t (powers of 1024)."""
    raw = env.get(name, "").strip().lower() or default
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmgt]?)i?b?", raw)
    if not match:
        raise ValueError(f"{name} must be a size such as 512m or 2g, not {raw!r}")
    return int(float(match[1]) * _BYTE_UNITS[match[2]])


def _str(env, name: str, default: str = "") -> str:
    return env.get(name, "").strip() or default


def _bool(env, name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    return default if not raw else raw in ("1", "true", "yes", "on")


def _list(env, name: str, default: str = "") -> tuple:
    return tuple(item.strip() for item in _str(env, name, default).split(",") if item.strip())


_DATASET_OVERRIDE = re.compile(r"^TERMPOOL_DATASET_(.+)_(ORIGIN|REF|SUBDIR)$")


def _dataset_sources(env) -> dict:
    """`dataset download` overrides: TERMPOOL_DATASET_<NAME>_ORIGIN / _REF / _SUBDIR as
    {name: {"origin"|"ref"|"subdir": value}}, only those set (an empty REF: the default branch)."""
    sources: dict = {}
    for key, value in env.items():
        match = _DATASET_OVERRIDE.match(key)
        if match:
            sources.setdefault(match[1].lower(), {})[match[2].lower()] = value.strip()
    return sources


def _sentinels(env) -> tuple:
    """REDIS_SENTINELS as ((host, port), ...): `host[:port]` entries, comma-separated, port 26379
    by default (a `[v6]:port` too)."""
    addresses = []
    for entry in _list(env, "REDIS_SENTINELS"):
        match = re.fullmatch(r"\[?([^\[\]]+?)\]?(?::(\d+))?", entry)
        if not match or (":" in match[1] and not entry.startswith("[")):
            raise ValueError(f"REDIS_SENTINELS entries must be host or host:port, not {entry!r}")
        addresses.append((match[1], int(match[2] or 26379)))
    return tuple(addresses)


def _containment(env) -> str:
    raw = _str(env, "CONTAINMENT", "on").lower()
    value = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(raw, raw)
    if value not in ("on", "off", "require"):
        raise ValueError(f"CONTAINMENT must be on, off or require, not {raw!r}")
    return value


_HOST_ALLOW_ENTRY = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?(?:/(tcp|udp))?")


def _host_allow(env) -> tuple:
    """CONTAINMENT_HOST_ALLOW as ((protocol, low, high), ...): comma-separated `port` or
    `low-high`, each with `/tcp` or `/udp` (both when neither), or `icmp` (ping the host)."""
    out = []
    for entry in _list(env, "CONTAINMENT_HOST_ALLOW"):
        if entry.lower() == "icmp":
            out.append(("icmp", 0, 0))
            continue
        match = _HOST_ALLOW_ENTRY.fullmatch(entry.lower())
        low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
        if not 1 <= low <= high <= 65535:
            raise ValueError(
                "CONTAINMENT_HOST_ALLOW entries must be a port or a range low-high within 1-65535, "
                f"optionally with /tcp or /udp, or icmp; not {entry!r}"
            )
        out += [(protocol, low, high) for protocol in ([match[3]] if match[3] else ["tcp", "udp"])]
    return tuple(out)


def _task_events(env) -> str:
    value = _str(env, "TASK_EVENTS", "monitor").lower()
    if value not in ("monitor", "always"):
        raise ValueError(f"TASK_EVENTS must be monitor or always, not {value!r}")
    return value


@dataclass(frozen=True)
class DiskFloor:
    """HOST_DISK_MIN_FREE: free space a host keeps on Docker's data root and the output root,
    in bytes and as a percent of the file system; a host under either takes no new runs."""

    bytes: int = 0
    percent: float = 0.0

    def short_of(self, free: int, total: int) -> bool:
        return free < self.bytes or (total > 0 and 100.0 * free / total < self.percent)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent else f"{self.bytes} bytes"


def _disk_floor(env, name: str, default: str) -> DiskFloor:
    """A size (as _bytes reads one) or a percent of the file system ("5%")."""
    raw = env.get(name, "").strip() or default
    if raw.endswith("%"):
        try:
            percent = float(raw[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent <= 100:
            raise ValueError(f"{name} must be a size such as 20g or a percent such as 5%, not {raw!r}")
        return DiskFloor(percent=percent)
    return DiskFloor(bytes=_bytes({name: raw}, name, default))


EMBEDDED_REGISTRY = "127.0.0.1:18082"  # REGISTRY_URL's default: scripts/start-backends.sh starts it


@dataclass(frozen=True)
class RegistrySettings:
    """The pool's image registry (environments/registry.py): `address` names images for Docker
    (host[:port]); `api` is the base URL termpool's own processes use for its HTTP API. The
    password stays out of reprs (and so out of logs and /status)."""

    address: str = EMBEDDED_REGISTRY  # "": no registry (REGISTRY_URL=off)
    api: str = "http://" + EMBEDDED_REGISTRY
    username: str = ""
    password: str = field(default="", repr=False)
    timeout: float = 3.0
    retention_days: float = 14.0  # 0: never reclaimed
    data_dir: Path = Path("/var/lib/termpool/registry")  # the embedded one's storage

    @property
    def enabled(self) -> bool:
        return bool(self.address)


def registry_address(raw: str, name: str = "REGISTRY_URL") -> tuple[str, str]:
    """A registry's address as (host[:port] for image names, base URL of its HTTP API). Written
    host[:port] or http(s)://host[:port]; without a scheme the API is plain HTTP on a loopback
    host (as Docker itself trusts 127.0.0.0/8), HTTPS elsewhere."""
    bad = f"{name} must be host[:port] or http(s)://host[:port], not {raw!r}"
    scheme, sep, rest = raw.partition("://")
    if not sep:
        scheme, rest = "", raw
    elif scheme.lower() not in ("http", "https"):
        raise ValueError(f"{bad}: the scheme must be http or https")
    rest = rest.rstrip("/") if sep else rest
    if not rest:
        raise ValueError(f"{bad}: the host is empty")
    if any(c in rest for c in "/?#@ "):
        raise ValueError(f"{bad}: no path, query, user or spaces, only host[:port]")
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:]*)(?::(.*))?", rest)
    if not re.fullmatch(r"\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", match[1]):
        raise ValueError(f"{bad}: the host is empty or not a host name")
    if match[2] is not None and not (match[2].isdigit() and 0 < int(match[2]) < 65536):
        raise ValueError(f"{bad}: the port must be a number from 1 to 65535")
    host = match[1].lower()
    if not scheme:
        loopback = host == "localhost" or host.startswith("127.") or host == "[::1]"
        scheme = "http" if loopback else "https"
    return rest.lower(), f"{scheme.lower()}://{rest.lower()}"


def load_registry(env=None) -> RegistrySettings:
    """The REGISTRY_* settings alone (scripts/start-backends.sh checks them before it starts one)."""
    env = os.environ if env is None else env
    raw = _str(env, "REGISTRY_URL")
    if raw.lower() == "off":
        address, api = "", ""
    else:
        address, api = registry_address(raw or EMBEDDED_REGISTRY)
    if _str(env, "REGISTRY_API_URL") and address:
        api = registry_address(_str(env, "REGISTRY_API_URL"), "REGISTRY_API_URL")[1]
    retention = _float(env, "REGISTRY_RETENTION_DAYS", 14.0)
    if retention < 0:
        raise ValueError(f"REGISTRY_RETENTION_DAYS must be 0 (never) or more, not {retention:g}")
    return RegistrySettings(
        address=address,
        api=api,
        username=_str(env, "REGISTRY_USERNAME"),
        password=env.get("REGISTRY_PASSWORD", ""),
        timeout=_positive(env, "REGISTRY_TIMEOUT", 3.0),
        retention_days=retention,
        data_dir=Path(_str(env, "REGISTRY_DATA_DIR", "/var/lib/termpool/registry")),
    )


@dataclass(frozen=True)
class Timeouts:
    """Per-operation time limits in seconds; a request may override any of them."""

    ensure_image: float = 300.0
    reset_session: float = 300.0
    close_session: float = 60.0
    eval: float = 600.0

    def merged(self, overrides: dict | None) -> Timeouts:
        """Apply a request's task_timeouts; values that are not positive numbers are ignored."""
        values = dict(self.__dict__)
        for key, value in (overrides or {}).items():
            if key in values and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                values[key] = float(value)
        return Timeouts(**values)


@dataclass(frozen=True)
class Settings:
    dataset_dir: Path
    output_root: Path
    port: int
    max_tasks: int
    max_runs_per_task: int
    run_idle_ttl: float
    allocated_ttl: float
    max_concurrent_closes: int
    image_source: str
    pull_prefix: str
    compose_override_path: str
    container_memory_limit: str
    container_pids_limit: int  # 0: no limit of termpool's
    container_cpu_limit: float  # 0: no limit of termpool's
    timeouts: Timeouts
    proxy_env: dict
    redis_url: str  # ignored when redis_sentinels is set
    # Sentinel deployments (poolcore/state/connection.py): the sentinels' addresses, the name
    # they monitor the primary by, their own password, and the primary's database and password.
    redis_sentinels: tuple  # ((host, port), ...); empty: REDIS_URL names the one Redis
    redis_sentinel_master: str
    redis_sentinel_password: str
    redis_db: int
    redis_password: str
    redis_outage_seconds: float  # how long a call waits for an unreachable Redis (connection.py)
    docker_outage_seconds: float  # how long a retryable job waits for its Docker engine to answer
    host_id: str
    concurrency: dict
    api_token: str
    allowed_clients: tuple
    flower_basic_auth: str
    flower_address: str  # "": 0.0.0.0 with basic auth, else 127.0.0.1 (tasks/flower.py)
    flower_max_tasks: int
    flower_purge_offline_workers: int
    flower_tasks_columns: str
    expose_kill_tool: bool
    warm_pool_size: int  # spares per one-service task and host at most; 0: no warm pool
    warm_pool_memory: int  # bytes of idle spares a host keeps at most (by measured footprint)
    warm_idle_ttl: float  # a spare unclaimed this long is removed (at most run_idle_ttl)
    warm_demand_window: float  # seconds of recent resets that size a task's pool
    session_output_limit: int
    observation_limit: int
    flower_port: int
    task_events: str  # monitor: task events only while a monitor (Flower) listens; always
    containment: str
    containment_interfaces: tuple
    containment_block: tuple
    containment_host_allow: tuple  # ((tcp | udp | icmp, low, high), ...): host ports task containers reach
    socket_dir: Path
    web_workers: int
    web_threads: int
    web_nice: int  # the facade's scheduling priority (nice value; negative: ahead of the workers)
    log_level: str
    access_log: bool  # one line per HTTP request on the facade's stdout
    dataset_sources: dict
    host_silence: float = 10.0  # HOST_SILENCE_SECONDS: a host's workers silent this long are lost
    # Host variables a Harbor task's ${VAR} templates may read (termpool/harbor_task.resolve_env)
    harbor_env_allowlist: tuple = ()
    container_disk_limit: int = 10 << 30  # bytes a run may write (writable layers, volumes, folders); 0: none
    disk_check_seconds: float = 10.0  # how often each host measures its live runs' disk use; 0: never
    host_disk_min_free: DiskFloor = DiskFloor(percent=5.0)
    record_ttl: int = 24 * 3600  # seconds closed runs and ended jobs stay readable in Redis
    run_folder_ttl: float = 3 * 24 * 3600.0  # RUN_FOLDER_TTL: a closed run's folder is removed this long after; 0: kept
    fork_max_depth: int = 4  # FORK_MAX_DEPTH: forks of forks at most this deep
    fork_processes: str = "auto"  # FORK_PROCESSES: auto (carry them where CRIU works) or off
    # RUN_SUBNETS / RUN_SUBNET_PREFIX: the blocks a host gives its runs' networks (poolcore/subnets.py)
    run_subnets: SubnetRange = SubnetRange("10.240.0.0/16", 26)
    # COMMAND_OUTPUT_LIMIT / COMMAND_MAX_TIMEOUT: a command's (app/commands_api.py) stdout and
    # stderr are each kept up to this many bytes; it runs this many seconds at most
    command_output_limit: int = 4 << 20
    command_max_timeout: float = 86400.0
    isolated_bridge_size: int = (
        1000  # ISOLATED_BRIDGE_SIZE: containers per termpool bridge (a Linux bridge: 1024 ports)
    )
    # Tasks sent by clients (POST /v1/tasks): how long one is kept after its last upload or run,
    # its bounds unpacked, and the folder where each worker host writes the ones its runs name.
    uploaded_task_ttl: float = 3 * 24 * 3600.0
    uploaded_task_max_bytes: int = 32 << 20
    uploaded_task_max_files: int = 10_000
    uploaded_tasks_dir: Path = Path("terminal-rl/uploaded_tasks").resolve()
    archive_max_bytes: int = 64 << 20  # ARCHIVE_MAX_BYTES: largest tar uploaded into or read out of a run
    archive_ttl: int = 600  # ARCHIVE_TTL: seconds an archive waits in Redis for its worker or its reader
    archive_read_timeout: float = 300.0  # ARCHIVE_READ_TIMEOUT: seconds an export's whole tar stream may take
    build_child_max_tasks: int = 100  # BUILD_CHILD_MAX_TASKS: builds per build process; 0: no limit
    image_disk_budget: int = 0  # IMAGE_DISK_BUDGET: bytes of task images a host keeps (image_budget.py); 0: no budget
    registry: RegistrySettings = RegistrySettings()  # REGISTRY_*: the pool's image registry
    tenants: Tenants = Tenants()  # TENANTS_FILE (poolcore/tenants.py); empty: one tenant, the operator

    @property
    def default_log_dir(self) -> Path:
        return self.output_root / "AgentRunner_Output"

    @property
    def uploaded_task_limits(self) -> Limits:
        return Limits(self.uploaded_task_max_bytes, self.uploaded_task_max_files)


QUEUE_KINDS = ("build", "lifecycle", "exec", "eval", "teardown")
# Flower's task table: the run id is in the kwargs column (tasks/flower.py).
FLOWER_TASK_COLUMNS = "name,uuid,state,kwargs,received,started,runtime,worker"


def _concurrency(env, max_tasks: int, max_runs: int, max_closes: int) -> dict:
    """Worker pool size per queue kind; sized so a full host never waits on the pool."""
    live_runs = max_tasks * max_runs
    defaults = {
        "build": 2,
        "lifecycle": max(4, min(live_runs, 32)),
        "exec": max(8, min(live_runs, 128)),
        "eval": max(4, min(live_runs, 64)),
        "teardown": max(1, max_closes),
    }
    return {kind: _int(env, f"{kind.upper()}_CONCURRENCY", value) for kind, value in defaults.items()}


def load_settings(env=None) -> Settings:
    env = os.environ if env is None else env
    max_tasks = _int(env, "WORKER_MAX_TASKS", 16)
    max_runs = _int(env, "WORKER_MAX_RUNS_PER_TASK", 8)
    max_closes = _int(env, "WORKER_MAX_CONCURRENT_CLOSES", 10)
    run_idle_ttl = _float(env, "WORKER_RUN_IDLE_TTL", 600.0)
    source = _str(env, "TBENCH_DOCKER_IMAGE_SOURCE", "build").lower()
    if source not in ("build", "pull"):
        raise ValueError(f"TBENCH_DOCKER_IMAGE_SOURCE must be 'build' or 'pull', not {source!r}")
    return Settings(
        dataset_dir=Path(_str(env, "DATASET_DIR", "terminal-rl/dataset")).resolve(),
        output_root=Path(_str(env, "TBENCH_OUTPUT_ROOT", "terminal-rl/build_outputs")).resolve(),
        port=_int(env, "ENV_SERVER_PORT", 18081),
        max_tasks=max_tasks,
        max_runs_per_task=max_runs,
        run_idle_ttl=run_idle_ttl,
        allocated_ttl=_float(env, "WORKER_ALLOCATED_TTL", 120.0),
        max_concurrent_closes=max_closes,
        image_source=source,
        pull_prefix=_str(env, "TBENCH_DOCKER_PULL_PREFIX"),
        compose_override_path=_str(env, "COMPOSE_OVERRIDE_PATH"),
        container_memory_limit=_str(env, "CONTAINER_MEMORY_LIMIT", "16g"),
        container_pids_limit=_int(env, "CONTAINER_PIDS_LIMIT", 4096),
        container_cpu_limit=_float(env, "CONTAINER_CPU_LIMIT", 2.0),
        timeouts=Timeouts(
            ensure_image=_float(env, "ENSURE_IMAGE_TIMEOUT", 300.0),
            reset_session=_float(env, "RESET_SESSION_TIMEOUT", 300.0),
            close_session=_float(env, "CLOSE_SESSION_TIMEOUT", 60.0),
            eval=_float(env, "EVAL_TIMEOUT", 600.0),
        ),
        proxy_env={k: env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY") if env.get(k)},
        redis_url=_str(env, "REDIS_URL", "redis://localhost:6379/0"),
        redis_sentinels=_sentinels(env),
        redis_sentinel_master=_str(env, "REDIS_SENTINEL_MASTER", "termpool"),
        redis_sentinel_password=_str(env, "REDIS_SENTINEL_PASSWORD"),
        redis_db=_int(env, "REDIS_DB", 0, minimum=0),
        redis_password=_str(env, "REDIS_PASSWORD"),
        redis_outage_seconds=_float(env, "REDIS_OUTAGE_SECONDS", 30.0),
        docker_outage_seconds=_float(env, "DOCKER_OUTAGE_SECONDS", 30.0),
        host_id=_str(env, "POOL_HOST_ID", socket.gethostname()),
        concurrency=_concurrency(env, max_tasks, max_runs, max_closes),
        api_token=_str(env, "POOL_API_TOKEN"),
        tenants=load_tenants(_str(env, "TENANTS_FILE"), _str(env, "POOL_API_TOKEN")),
        allowed_clients=_list(env, "POOL_ALLOWED_CLIENTS"),
        flower_basic_auth=_str(env, "FLOWER_BASIC_AUTH"),
        flower_address=_str(env, "FLOWER_ADDRESS"),
        flower_max_tasks=_int(env, "FLOWER_MAX_TASKS", 10_000, minimum=0),
        flower_purge_offline_workers=_int(env, "FLOWER_PURGE_OFFLINE_WORKERS", 3600, minimum=0),
        flower_tasks_columns=_str(env, "FLOWER_TASKS_COLUMNS", FLOWER_TASK_COLUMNS),
        expose_kill_tool=_bool(env, "POOL_EXPOSE_KILL_TOOL"),
        warm_pool_size=_int(env, "WARM_POOL_SIZE", 8, minimum=0),
        warm_pool_memory=_bytes(env, "WARM_POOL_MEMORY", "2g"),
        warm_idle_ttl=min(_float(env, "WARM_IDLE_TTL", 180.0), run_idle_ttl),
        warm_demand_window=_float(env, "WARM_DEMAND_WINDOW", 60.0),
        session_output_limit=_int(env, "SESSION_OUTPUT_LIMIT", 16 << 20),
        observation_limit=_int(env, "OBSERVATION_LIMIT", 64 << 10),
        flower_port=_int(env, "FLOWER_PORT", 5555, minimum=0),
        task_events=_task_events(env),
        containment=_containment(env),
        containment_interfaces=_list(env, "CONTAINMENT_INTERFACES", "docker0,br-+"),
        containment_block=_list(env, "CONTAINMENT_BLOCK"),
        containment_host_allow=_host_allow(env),
        socket_dir=Path(_str(env, "POOL_SOCKET_DIR", "/run/termpool")),
        web_workers=_int(env, "WEB_CONCURRENCY", 2),
        web_threads=_int(env, "WEB_THREADS", 256),
        web_nice=_nice(env, "WEB_NICE", -5),
        log_level=_str(env, "LOG_LEVEL", "INFO").upper(),
        access_log=_bool(env, "ACCESS_LOG"),
        dataset_sources=_dataset_sources(env),
        host_silence=_float(env, "HOST_SILENCE_SECONDS", 10.0),
        harbor_env_allowlist=_list(env, "HARBOR_ENV_ALLOWLIST"),
        container_disk_limit=_bytes(env, "CONTAINER_DISK_LIMIT", "10g"),
        disk_check_seconds=_float(env, "DISK_CHECK_SECONDS", 10.0),
        host_disk_min_free=_disk_floor(env, "HOST_DISK_MIN_FREE", "5%"),
        record_ttl=_int(env, "RECORD_TTL", 24 * 3600, minimum=60),
        run_folder_ttl=_float(env, "RUN_FOLDER_TTL", 3 * 24 * 3600.0),
        fork_max_depth=_int(env, "FORK_MAX_DEPTH", 4, minimum=1),
        fork_processes=_fork_processes(env),
        run_subnets=parse(_str(env, "RUN_SUBNETS", "10.240.0.0/16"), _int(env, "RUN_SUBNET_PREFIX", 26)),
        isolated_bridge_size=_bridge_size(env),
        uploaded_task_ttl=_float(env, "UPLOADED_TASK_TTL", 3 * 24 * 3600.0),
        uploaded_task_max_bytes=_bytes(env, "UPLOADED_TASK_MAX_BYTES", "32m"),
        uploaded_task_max_files=_int(env, "UPLOADED_TASK_MAX_FILES", 10_000, minimum=1),
        uploaded_tasks_dir=Path(_str(env, "UPLOADED_TASKS_DIR", "terminal-rl/uploaded_tasks")).resolve(),
        command_output_limit=_bytes(env, "COMMAND_OUTPUT_LIMIT", "4m"),
        command_max_timeout=_positive(env, "COMMAND_MAX_TIMEOUT", 86400.0),
        archive_max_bytes=_bytes(env, "ARCHIVE_MAX_BYTES", "64m"),
        archive_ttl=_int(env, "ARCHIVE_TTL", 600, minimum=10),
        archive_read_timeout=max(_float(env, "ARCHIVE_READ_TIMEOUT", 300.0), 1.0),
        build_child_max_tasks=_int(env, "BUILD_CHILD_MAX_TASKS", 100, minimum=0),
        image_disk_budget=_bytes(env, "IMAGE_DISK_BUDGET", "0"),
        registry=load_registry(env),
    )


def _positive(env, name: str, default: float) -> float:
    value = _float(env, name, default)
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return value


def _bridge_size(env) -> int:
    value = _int(env, "ISOLATED_BRIDGE_SIZE", 1000, minimum=1)
    if value > 1000:  # a Linux bridge takes at most 1024 ports; leave room for starts in flight
        raise ValueError(f"ISOLATED_BRIDGE_SIZE must be at most 1000, not {value}")
    return value


def _fork_processes(env) -> str:
    value = _str(env, "FORK_PROCESSES", "auto").lower()
    if value not in ("auto", "off"):
        raise ValueError(f"FORK_PROCESSES must be 'auto' or 'off', not {value!r}")
    return value


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """The process's settings, read once."""
    return load_settings()
