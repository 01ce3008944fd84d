"""What termpool adds to a task's containers, merged with what the task's file already sets.

Both start paths take their container settings from here: the compose override (any task)
and the SDK create options (the one-service fast path), so the two produce the same container.

Limits, where the task sets its own:
  * memory (client): the lower of the task's and CONTAINER_MEMORY_LIMIT; memory+swap equals it;
  * pids (every service): the lower of the task's and CONTAINER_PIDS_LIMIT;
  * cpus (client): the task's own value wins; CONTAINER_CPU_LIMIT applies when it sets none.
Each value goes where the task put its own (`deploy.resources.limits` or the service-level
key): compose refuses distinct values in the two places.
"""

from __future__ import annotations

from pathlib import Path

from docker.utils import parse_bytes, split_command

from environments.compose_config import client_candidates, client_service, service_images
from poolcore.config import Settings

# Keys of a resolved client service that the SDK fast path reproduces exactly.
DIRECT_SERVICE_KEYS = {
    "build",
    "image",
    "container_name",
    "command",
    "entrypoint",
    "environment",
    "volumes",
    "working_dir",
    "user",
    "networks",
    "cpus",  # the task's own limits: limits() merges them as compose would
    "mem_limit",
}
DIRECT_BIND_KEYS = {"type", "source", "target", "bind", "read_only"}
NANO = 1_000_000_000


def _positive(value) -> float | None:
    if value in (None, ""):
        return None
    number = float(value)
    return number if number > 0 else None


def _lower(*values) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def memory_cap(cfg: Settings) -> int | None:
    return _positive(parse_bytes(cfg.container_memory_limit)) if cfg.container_memory_limit else None


def limits(service: dict, cfg: Settings, is_client: bool, max_cpus: float) -> dict:
    """The override fragment with termpool's limits for one resolved service."""
    deploy = (service.get("deploy") or {}).get("resources") or {}
    own = deploy.get("limits")
    chosen = {}  # deploy.resources.limits name -> value
    pids = _lower(_positive((own or {}).get("pids") or service.get("pids_limit")), _positive(cfg.container_pids_limit))
    if pids:
        chosen["pids"] = int(pids)
    if is_client:
        memory = _lower(_positive((own or {}).get("memory") or service.get("mem_limit")), memory_cap(cfg))
        if memory:
            chosen["memory"] = str(int(memory))
        if not _positive((own or {}).get("cpus") or service.get("cpus")) and cfg.container_cpu_limit > 0:
            chosen["cpus"] = round(min(cfg.container_cpu_limit, max_cpus), 2)
    fragment = {}
    if "memory" in chosen:
        fragment["memswap_limit"] = chosen["memory"]  # no swap beyond the memory limit
        fragment.update(_capped_reservations(service, deploy, int(chosen["memory"])))
    service_keys = {"pids": "pids_limit", "memory": "mem_limit", "cpus": "cpus"}
    if own is None:
        fragment.update({service_keys[k]: v for k, v in chosen.items()})
        return fragment
    # The task uses deploy.resources.limits: ours go there too, and a service-level key it also
    # set (compose accepts equal values in both places) gets the same value.
    _merge(fragment, {"deploy": {"resources": {"limits": chosen}}})
    fragment.update({service_keys[k]: v for k, v in chosen.items() if service_keys[k] in service})
    return fragment


def _capped_reservations(service: dict, deploy: dict, memory: int) -> dict:
    """A reservation above the (lowered) limit would make docker refuse the container."""
    out = {}
    reserved = _positive((deploy.get("reservations") or {}).get("memory"))
    if reserved and reserved > memory:
        out["deploy"] = {"resources": {"reservations": {"memory": str(memory)}}}
    if (_positive(service.get("mem_reservation")) or 0) > memory:
        out["mem_reservation"] = str(memory)
    return out


def _merge(into: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _proxy_env(service: dict, cfg: Settings) -> dict:
    """HTTP(S)_PROXY / NO_PROXY for a container, unless the task sets its own."""
    own = service.get("environment") or {}
    return {k: v for k, v in cfg.proxy_env.items() if k not in own}


def run_override(
    resolved: dict,
    task_name: str,
    labels: dict,
    name: str,
    mounts: list[str],
    cfg: Settings,
    max_cpus: float,
    client_entry: dict | None = None,
    subnets: dict | None = None,
) -> dict:
    """The compose file termpool layers over the task's for one run (or, without a name, a build);
    `labels` go on the run's containers, networks and volumes (a build's: on each image it
    builds), `mounts` are termpool's own binds on the client ("src:dst:mode"), `client_entry`
    more of its keys (entrypoint and command), `subnets` each network's block of the host's
    range (networks_needing_subnets). The client is the agent's service of a model resolved
    with `name` as the client container name (compose_config.client_service)."""
    client = client_service(resolved, name) if name else ""
    images = service_images(task_name, resolved)
    services = {}
    for svc_name, svc in resolved["services"].items():
        entry = {"image": images[svc_name]} if svc_name in images else {}
        if name:
            entry.update(labels=labels, **limits(svc, cfg, svc_name == client, max_cpus))
            if _proxy_env(svc, cfg):
                entry["environment"] = _proxy_env(svc, cfg)
        elif labels and "build" in svc:  # merged with the task's own build labels by compose
            entry["build"] = {"labels": labels}
        services[svc_name] = entry
    override = {"services": services}
    if name:
        services[client].update(container_name=name, init=True, **_literal(client_entry or {}))
        if mounts:
            services[client]["volumes"] = list(mounts)
        _run_scoped_names(resolved, services, client, name)
        for kind in ("networks", "volumes"):
            override[kind] = {
                key: _run_scoped(resolved["name"], key, item, labels)
                for key, item in (resolved.get(kind) or {}).items()
                if not item.get("external")
            }
        for key, subnet in (subnets or {}).items():
            override["networks"][key]["ipam"] = {"config": [{"subnet": subnet}]}
    return override


def networks_needing_subnets(resolved: dict) -> list[str]:
    """The run's networks that take a block of termpool's range: the bridge networks its
    services join that it creates itself (not external) and whose subnet the task leaves open
    (a pinned one keeps the task's, and the one-per-host rule: poolcore/task_spec.py)."""
    used = {key for svc in resolved["services"].values() for key in svc.get("networks") or {}}
    return [
        key
        for key, item in (resolved.get("networks") or {}).items()
        if key in used
        and not item.get("external")
        and item.get("driver", "bridge") in ("bridge", "", None)
        and not any(entry.get("subnet") for entry in (item.get("ipam") or {}).get("config") or [])
    ]


def _literal(value):
    """Values as the container gets them (unescaped), for the override file, where compose
    interpolates: each `$` doubled, so the container gets them unchanged."""
    return _map_strings(value, lambda text: text.replace("$", "$$"))


def _map_strings(value, fn):
    """`value` with `fn` applied to every string in it (lists and mappings walked)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(item, fn) for item in value]
    if isinstance(value, dict):
        return {key: _map_strings(item, fn) for key, item in value.items()}
    return value


def _run_scoped_names(resolved: dict, services: dict, client: str, project: str) -> None:
    """A fixed container_name of another service becomes the run's own, so two runs of a task
    can live at once; the old name stays reachable as an alias on the service's networks."""
    for svc_name, svc in resolved["services"].items():
        fixed = svc.get("container_name")
        if svc_name == client or not fixed:
            continue
        services[svc_name]["container_name"] = f"{project}-{svc_name}"
        networks = svc.get("networks") or {}
        if networks:
            services[svc_name]["networks"] = {
                key: {"aliases": [*((networks[key] or {}).get("aliases") or []), fixed]} for key in networks
            }


def _run_scoped(project: str, key: str, item: dict, labels: dict) -> dict:
    """Labels on every network and volume of the run, so its teardown and the reconcile sweep
    find them; a fixed `name:` becomes the run's own (as above): two live runs would otherwise
    share it, and the first teardown would remove it from under the second."""
    own = f"{project}_{key}"
    return {"labels": labels} if item.get("name", own) == own else {"labels": labels, "name": own}


# ---- the SDK fast path ----------------------------------------------------------------------
def direct_eligible(resolved: dict, build_dir: Path, image: str, client_name: str) -> bool:
    """True when the resolved file is one service, the agent's (compose_config.client_candidates;
    whatever its name), that create+start reproduces: no settings beyond DIRECT_SERVICE_KEYS,
    the default network only, plain bind mounts, and a build of `build_dir` (the task folder, a
    Harbor task's environment/) into the client image. `client_name` is the client container
    name the model was resolved with."""
    if set(resolved) - {"name", "networks", "services"} or list(resolved["services"]) != client_candidates(
        resolved, client_name
    ):
        return False
    networks = resolved.get("networks") or {}
    if (
        set(networks) - {"default"}
        or set(networks.get("default") or {}) - {"name", "ipam"}
        or (networks.get("default") or {}).get("ipam")
    ):
        return False
    [svc] = resolved["services"].values()
    build = svc.get("build")
    return (
        not set(svc) - DIRECT_SERVICE_KEYS
        and svc.get("networks", {"default": None}) == {"default": None}
        and svc.get("image", image) == image
        and (
            build is None
            or (
                not set(build) - {"context", "dockerfile"}
                and Path(build.get("context", "")).resolve() == Path(build_dir).resolve()
            )
        )
        and all(
            isinstance(v, dict)
            and v.get("type") == "bind"
            and not set(v) - DIRECT_BIND_KEYS
            and not set(v.get("bind") or {}) - {"create_host_path"}
            for v in svc.get("volumes") or []
        )
    )


def unescaped(value):
    """A value of compose's resolved model as the container gets it: `docker compose config`
    writes a literal `$` (`$$` in the task's file) as `$$` again, so its output stays a valid
    compose file; compose itself makes it one `$` when it creates the container."""
    return _map_strings(value, lambda text: text.replace("$$", "$"))


def direct_options(resolved: dict, client: str, cfg: Settings, mounts: list[str], max_cpus: float) -> dict:
    """containers.create() keyword arguments equal to what compose does with run_override for
    the agent's service `client`."""
    svc = resolved["services"][client]
    svc = {
        **svc,
        **unescaped({k: svc[k] for k in ("command", "entrypoint", "environment", "working_dir", "user") if k in svc}),
    }
    environment = {k: v for k, v in (svc.get("environment") or {}).items() if v is not None}
    # "src:dst:rw" as compose writes its binds
    volumes = [f"{v['source']}:{v['target']}:{'ro' if v.get('read_only') else 'rw'}" for v in svc.get("volumes") or []]
    fragment = limits(svc, cfg, True, max_cpus)
    options = dict(
        command=svc.get("command"),
        entrypoint=svc.get("entrypoint"),
        environment={**environment, **_proxy_env(svc, cfg)},
        volumes=volumes + list(mounts),
        init=True,
        privileged=False,
    )
    if svc.get("working_dir"):
        options["working_dir"] = svc["working_dir"]
    if svc.get("user"):
        options["user"] = svc["user"]
    if "mem_limit" in fragment:
        options.update(mem_limit=int(fragment["mem_limit"]), memswap_limit=int(fragment["memswap_limit"]))
    cpus = fragment.get("cpus") or _positive(svc.get("cpus"))  # termpool's, else the task's own
    if cpus:
        options["nano_cpus"] = int(round(cpus * NANO))
    if "pids_limit" in fragment:
        options["pids_limit"] = fragment["pids_limit"]
    return options


def _argv(value) -> list[str] | None:
    if value is None:
        return None
    return split_command(value) if isinstance(value, str) else [str(part) for part in value]


def own_command(options: dict, image_config: dict) -> list[str]:
    """The argv a container created with these create() options (or this resolved service,
    unescaped) runs, as the Docker daemon derives it: with no entrypoint of its own, the
    image's command stands in for a missing command, and the image's entrypoint for an unset
    (not an empty) one."""
    entrypoint, command = _argv(options.get("entrypoint")), _argv(options.get("command"))
    if not entrypoint:
        if not command:
            command = _argv(image_config.get("Cmd"))
        if entrypoint is None:
            entrypoint = _argv(image_config.get("Entrypoint"))
    return (entrypoint or []) + (command or [])
