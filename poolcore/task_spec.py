"""Read a terminal-bench task directory (docs/task-format.md). Pure logic + PyYAML."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from poolcore.harbor_task import (
    HarborConfig,
    HarborTaskError,
    HarborUnsupported,
    is_harbor_folder,
    is_harbor_task,
    load_harbor,
)

DEFAULT_PARSER = "pytest"
DEFAULT_AGENT_TIMEOUT_SEC = 360.0
DEFAULT_TEST_TIMEOUT_SEC = 60.0
COMPOSE_FILE_NAMES = ("docker-compose.yaml", "docker-compose.yml")
TEST_TIMEOUT_FACTOR = 4  # the test script may run 4 x max_test_timeout_sec


class TaskError(ValueError):
    """A task directory is missing something or its task.yaml is not usable."""


class NoGrader(TaskError):
    """The task directory has no run-tests.sh."""


class Unsupported(TaskError):
    """The task asks for something termpool does not do (TASK_UNSUPPORTED, not TASK_INVALID)."""


def is_task_dir(path: Path | str) -> bool:
    """A task folder of either format: task.yaml (terminal-bench), or task.toml and
    instruction.md (Harbor)."""
    return (Path(path) / "task.yaml").is_file() or is_harbor_task(path)


@dataclass(frozen=True)
class TaskSpec:
    """What termpool uses of task.yaml; other keys (difficulty, author, tags, ...) are metadata
    it does not read."""

    path: Path
    name: str
    instruction: str
    parser_name: str = DEFAULT_PARSER
    max_agent_timeout_sec: float = DEFAULT_AGENT_TIMEOUT_SEC
    max_test_timeout_sec: float = DEFAULT_TEST_TIMEOUT_SEC
    # Why two live runs of the task cannot share one Docker daemon (see one_per_host); empty
    # for most tasks. Placement then allows one live run of its key per host.
    one_per_host: tuple[str, ...] = ()
    harbor: HarborConfig | None = None  # set for a task in Harbor's format (poolcore/harbor_task.py)
    # The task's own disk request in MB (Harbor's environment.storage_mb), None when it names none.
    # A run's disk limit is the lower of it and the CONTAINER_DISK_LIMIT setting.
    disk_limit_mb: int | None = None

    @property
    def has_tests(self) -> bool:
        """False for a bare Harbor environment (an uploaded task without tests)."""
        return self.harbor is None or self.harbor.has_tests

    def test_time_limit(self, eval_timeout: float) -> float:
        """Seconds the test script may run: min(eval timeout, 4 x max_test_timeout_sec), or for a
        Harbor task min(eval timeout, its verifier.timeout_sec)."""
        if self.harbor is not None:
            return min(float(eval_timeout), self.harbor.verifier_timeout_sec)
        return min(float(eval_timeout), TEST_TIMEOUT_FACTOR * self.max_test_timeout_sec)


def _positive_number(data: dict, key: str, default: float, source: Path) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise TaskError(f"{source}: {key} must be a number of seconds, not {data[key]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TaskError(f"{source}: {key} must be a number of seconds, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise TaskError(f"{source}: {key} must be a positive number of seconds, not {value!r}")
    return float(value)


def _boolean(data: dict, key: str, default: bool, source: Path) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return value.strip().lower() in ("true", "yes", "on", "1")
    raise TaskError(f"{source}: {key} must be true or false, not {value!r}")


def _instruction(data: dict, source: Path) -> str:
    value = data.get("instruction")
    if value is None:
        # Older terminal-bench tasks kept it under descriptions: [{key: base, description}].
        descriptions = data.get("descriptions")
        if isinstance(descriptions, list):
            for item in descriptions:
                if isinstance(item, dict) and item.get("key") == "base" and isinstance(item.get("description"), str):
                    value = item["description"]
                    break
    if value is None:
        raise TaskError(f"{source}: the required key 'instruction' is missing")
    if not isinstance(value, str):
        raise TaskError(f"{source}: 'instruction' must be a string, not {type(value).__name__}")
    if not value.strip():
        raise TaskError(f"{source}: 'instruction' is empty")
    return value


def load_task(task_dir: Path | str) -> TaskSpec:
    """Read and check one task directory; TaskError says what is wrong."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise TaskError(f"task directory {task_dir} does not exist")
    source = task_dir / "task.yaml"
    if is_harbor_folder(task_dir):  # a bare environment too (an uploaded task)
        return _load_harbor(task_dir)
    if not source.is_file():
        raise TaskError(f"{task_dir}: no task.yaml (nor task.toml and instruction.md)")
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"{source}: cannot read it: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TaskError(f"{source}: invalid YAML: {exc}") from None
    if data is None:
        raise TaskError(f"{source}: the file is empty; it needs at least 'instruction'")
    if not isinstance(data, dict):
        raise TaskError(f"{source}: must be a YAML mapping of keys, not {type(data).__name__}")

    instruction = _instruction(data, source)
    parser_name = data.get("parser_name")
    if parser_name is None:
        parser_name = DEFAULT_PARSER
    elif not isinstance(parser_name, str) or not parser_name.strip():
        raise TaskError(f"{source}: parser_name must be a non-empty string, not {parser_name!r}")
    spec = TaskSpec(
        path=task_dir,
        name=task_dir.name,
        instruction=instruction,
        parser_name=parser_name.strip(),
        max_agent_timeout_sec=_positive_number(data, "max_agent_timeout_sec", DEFAULT_AGENT_TIMEOUT_SEC, source),
        max_test_timeout_sec=_positive_number(data, "max_test_timeout_sec", DEFAULT_TEST_TIMEOUT_SEC, source),
        one_per_host=_compose_reasons(task_dir),
    )
    # Checked as terminal-bench does, not used: the tests always run in an exec of their own.
    _boolean(data, "run_tests_in_same_shell", False, source)
    if not (task_dir / "run-tests.sh").is_file():
        raise NoGrader(f"{task_dir}: no run-tests.sh (the grader the pool runs)")
    return spec


def _load_harbor(task_dir: Path) -> TaskSpec:
    try:
        instruction, timeouts, config = load_harbor(task_dir)
    except HarborUnsupported as exc:
        raise Unsupported(str(exc)) from None
    except HarborTaskError as exc:
        raise TaskError(str(exc)) from None
    return TaskSpec(
        path=task_dir,
        name=task_dir.name,
        instruction=instruction,
        parser_name="harbor-reward",
        max_test_timeout_sec=config.verifier_timeout_sec,
        one_per_host=_compose_reasons(task_dir),
        harbor=config,
        disk_limit_mb=config.storage_mb,
        **timeouts,
    )


# load_task_cached's specs by task folder, with the stamp of the task.yaml and compose file
# they were read from.
_SPECS: dict[Path, tuple[tuple, TaskSpec]] = {}
_SPECS_MAX = 4096
HARBOR_STAMPED = (
    "task.toml",
    "instruction.md",
    "environment/docker-compose.yaml",
    "environment/docker-compose.yml",
    "environment/Dockerfile",
    "steps",
)


def _stamp(path: Path) -> tuple | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_ino, info.st_mtime_ns, info.st_size)


def load_task_cached(task_dir: Path | str) -> TaskSpec:
    """load_task, parsing task.yaml (and the compose file) again only when one changed (inode,
    mtime or size): every reset reads its task, and YAML parsing is most of what a warm reset
    costs a worker."""
    task_dir = Path(task_dir)
    harbor = is_harbor_folder(task_dir)
    files = HARBOR_STAMPED if harbor else ("task.yaml", *COMPOSE_FILE_NAMES)
    stamp = tuple(_stamp(task_dir / name) for name in files)
    if stamp[0] is None:
        return load_task(task_dir)  # which says what is wrong
    known = _SPECS.get(task_dir)
    grader = "tests/test.sh" if harbor else "run-tests.sh"
    if known and known[0] == stamp and ((task_dir / grader).is_file() or not known[1].has_tests):
        return known[1]
    spec = load_task(task_dir)
    if len(_SPECS) >= _SPECS_MAX:
        _SPECS.clear()
    _SPECS[task_dir] = (stamp, spec)
    return spec


# ---- what two live runs of a task cannot share ------------------------------------------
# termpool makes container, network and volume names run-specific, but an address the compose
# file pins is the same for every run, and one Docker daemon hands it out once: a second run's
# `up` fails ("Pool overlaps", "Address already in use", "port is already allocated"). Read
# from the raw file: the keys' presence is enough, so no interpolation (nor compose) is needed,
# and the facade may call this.
IPAM_KEYS = ("subnet", "ip_range", "gateway")
ADDRESS_KEYS = ("ipv4_address", "ipv6_address")


def one_per_host(compose: object) -> tuple[str, ...]:
    """Why two live runs of a task with this compose file (as written, parsed) cannot share a
    Docker daemon: fixed subnets, ip ranges or gateways of its networks, static addresses of its
    services, host ports it publishes. Empty when nothing pins them."""
    if not isinstance(compose, dict):
        return ()
    reasons = []
    for key, net in _mapping(compose.get("networks")).items():
        ipam = _mapping(_mapping(net).get("ipam"))
        for config in ipam.get("config") or []:
            for field in IPAM_KEYS:
                if isinstance(config, dict) and config.get(field):
                    reasons.append(f"fixed {field.replace('_', ' ')} {config[field]} (network {key!r})")
    for name, svc in _mapping(compose.get("services")).items():
        svc = _mapping(svc)
        for attached in _mapping(svc.get("networks")).values():
            reasons += [
                f"static address {address} (service {name!r})"
                for address in (_mapping(attached).get(field) for field in ADDRESS_KEYS)
                if address
            ]
        ports = svc.get("ports")
        for port in ports if isinstance(ports, list) else []:
            published = _published(port)
            if published:
                reasons.append(f"fixed host port {published} (service {name!r})")
    return tuple(reasons)


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _published(port: object) -> str:
    """The host port of one `ports` entry when it is fixed, else "" (Docker picks one).
    Short syntax [HOST_IP:][HOST_PORT:]CONTAINER_PORT[/PROTOCOL], or the long syntax's mapping."""
    if isinstance(port, dict):
        return str(port.get("published") or "")
    if not isinstance(port, str) or ":" not in port:
        return ""  # a bare container port (number or string): a random host port
    host = port.rsplit(":", 1)[0]
    if "$" in host:
        return host  # a variable: whatever it holds, shown as written
    if host.startswith("[") and "]:" not in host:
        return ""  # [IPv6]:CONTAINER_PORT
    return host.rsplit(":", 1)[-1]


class _ComposeLoader(yaml.SafeLoader):
    """Reads a compose file as compose does in one respect: YAML 1.1's base-60 integers are
    strings in YAML 1.2, so an unquoted `- 2222:22` stays a port mapping, not 133342."""


def _int_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode):
    return node.value if ":" in node.value else loader.construct_yaml_int(node)


_ComposeLoader.add_constructor("tag:yaml.org,2002:int", _int_or_text)


def _compose_reasons(task_dir: Path) -> tuple[str, ...]:
    """one_per_host of the task's compose file; () when it has none or it does not parse (its
    start says what is wrong)."""
    try:
        text = compose_file(task_dir).read_text(encoding="utf-8")
        return one_per_host(yaml.load(text, Loader=_ComposeLoader))  # a SafeLoader
    except (TaskError, OSError, ValueError, yaml.YAMLError):
        return ()


def one_per_host_reasons(task_dir: Path | str) -> tuple[str, ...]:
    """TaskSpec.one_per_host of a task folder, read through load_task_cached; a task whose
    task.yaml is unusable (its reset fails anyway) is read uncached."""
    try:
        return load_task_cached(task_dir).one_per_host
    except TaskError:
        return _compose_reasons(Path(task_dir))


def compose_file(task_dir: Path | str) -> Path:
    """The task's docker-compose.yaml (or .yml; a Harbor task's in environment/); TaskError when
    there is none."""
    task_dir = Path(task_dir)
    if is_harbor_folder(task_dir):
        task_dir = task_dir / "environment"
    for name in COMPOSE_FILE_NAMES:
        candidate = task_dir / name
        if candidate.is_file():
            return candidate
    raise TaskError(f"{task_dir}: no docker-compose.yaml or docker-compose.yml")


_NOT_IN_IMAGE_NAME = re.compile(r"[^a-z0-9_.-]")

# A task name becomes part of image, compose project and container names (image_name,
# name_prefix): alphanumeric runs joined by one separator each, where a run of dots and dashes
# (dots become dashes) or one or two underscores are the separators Docker's reference grammar
# allows. 100 characters keep ``<name>.<uid>.<run id>`` under the 255-byte file name limit.
TASK_NAME_PATTERN = r"^[A-Za-z0-9]+(?:(?:[-.]+|_{1,2})[A-Za-z0-9]+)*$"
MAX_TASK_NAME_LENGTH = 100


def valid_task_name(name: object) -> bool:
    """Whether ``name`` maps to valid Docker names (see TASK_NAME_PATTERN)."""
    return (
        isinstance(name, str)
        and len(name) <= MAX_TASK_NAME_LENGTH
        and re.fullmatch(TASK_NAME_PATTERN, name) is not None
    )


def _docker_task_name(task_name: str) -> str:
    if not isinstance(task_name, str) or not task_name.strip():
        raise TaskError(f"task name must be a non-empty string, not {task_name!r}")
    name = task_name.strip().lower().replace(".", "-")
    return _NOT_IN_IMAGE_NAME.sub("-", name)


def name_prefix(task_name: str) -> str:
    """``tb__<task>``: dots become dashes, lowercased (T_BENCH_TASK_DOCKER_NAME_PREFIX)."""
    return f"tb__{_docker_task_name(task_name)}"


def image_name(task_name: str) -> str:
    """``tb__<task>__client``: the client image built from the task (dots -> dashes)."""
    return f"{name_prefix(task_name)}__client"
