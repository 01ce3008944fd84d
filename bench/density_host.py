"""The host side of the density benchmark: memory by owner, what a stack left behind, and the
floor of a two-service start (the raw Docker SDK doing what compose does for one run).

Memory is read where it is kept, not estimated: each container's cgroup (v1: usage less
inactive file cache, as `docker stats` counts it), the PSS of the containers' shims (one per
container), the RSS of Docker's daemons (dockerd, containerd), and the machine's MemAvailable
(which also sees what the kernel spends per run: network namespaces, veth pairs, bridges,
overlay mounts).
"""

from __future__ import annotations

import ipaddress
import os
import uuid
from pathlib import Path

import docker.errors
import psutil
from docker.types import IPAMConfig, IPAMPool

from bench.episodes import Floor
from environments.docker_client import HOST_LABEL

MB = 1024 * 1024
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory/docker")
SERVICE_LABEL = "com.docker.compose.service"
FLOOR_LABEL = "termpool.bench-density"  # the floor's own resources, valued by the stack's host id
DOCKER_PROCESSES = ("dockerd", "containerd")


# ---- memory ---------------------------------------------------------------------------------
def cgroup_bytes(container_id: str) -> int | None:
    """A container's memory as `docker stats` counts it; None when its cgroup is not there."""
    folder = MEMORY_CGROUPS / container_id
    try:
        usage = int((folder / "memory.usage_in_bytes").read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    return max(0, usage - int(stat.get("total_inactive_file", 0)))


def containers_memory(client, host_id: str) -> dict:
    """Summed cgroup memory of the host's running containers, in all and by compose service, and
    the PSS of their containerd shims (Docker starts one per container)."""
    found = client.containers.list(filters={"label": f"{HOST_LABEL}={host_id}"}, ignore_removed=True)
    by_service: dict[str, float] = {}
    unread = 0
    for container in found:
        used = cgroup_bytes(container.id)
        if used is None:
            unread += 1
            continue
        service = container.labels.get(SERVICE_LABEL, "client")
        by_service[service] = by_service.get(service, 0.0) + used / MB
    shims = shims_pss({container.id for container in found})
    return {
        "containers": len(found),
        "unread": unread,
        "total_mb": round(sum(by_service.values()), 1),
        "by_service_mb": _rounded(by_service),
        "shims": len(shims),
        "shims_mb": round(sum(shims) / MB, 1),
    }


def shims_pss(container_ids: set[str]) -> list[int]:
    """Proportional memory (PSS) of the containerd shims of these containers (a shim's argv
    names its container: -id). PSS, not RSS: the shims share their binary's pages, which RSS
    would count once per shim."""
    out = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        argv = proc.info["cmdline"] or []
        shim = (proc.info["name"] or "").startswith("containerd-shim") and "-id" in argv[:-1]
        if shim and argv[argv.index("-id") + 1] in container_ids:
            try:
                out.append(proc.memory_full_info().pss)
            except psutil.Error:
                pass
    return out


def docker_daemons_mb() -> float:
    """RSS of dockerd and containerd: shared by every user of the daemon, so only indicative."""
    rss = sum(
        p.info["memory_info"].rss
        for p in psutil.process_iter(["name", "memory_info"])
        if p.info["name"] in DOCKER_PROCESSES and p.info["memory_info"]
    )
    return round(rss / MB, 1)


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return round(int(fields["MemAvailable"].split()[0]) / 1024, 1)


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _rounded(values: dict) -> dict:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in sorted(values.items())}


# ---- what a stack left ----------------------------------------------------------------------
def left_behind(client, host_id: str, projects: list[str] = ()) -> dict:
    """Containers, networks and volumes labelled with the host id, and networks of the runs'
    compose projects (named `<project>_...`, whatever their labels say)."""
    label = {"label": f"{HOST_LABEL}={host_id}"}
    networks = {n.name for n in client.networks.list(filters=label)}
    prefixes = tuple(f"{project}_" for project in projects)
    networks |= {n.name for n in client.networks.list() if prefixes and n.name.startswith(prefixes)}
    return {
        "containers": sorted(c.name for c in client.containers.list(all=True, filters=label, ignore_removed=True)),
        "networks": sorted(networks),
        "volumes": sorted(v.name for v in client.volumes.list(filters=label)),
    }


def remove_left(client, left: dict) -> None:
    """Remove what left_behind found (the next phase starts clean; the finding stays reported)."""
    for name in left["containers"]:
        _quietly(lambda n=name: client.containers.get(n).remove(force=True, v=True))
    for name in left["networks"]:
        _quietly(lambda n=name: client.networks.get(n).remove())
    for name in left["volumes"]:
        _quietly(lambda n=name: client.volumes.get(n).remove(force=True))


def _quietly(fn) -> None:
    try:
        fn()
    except docker.errors.NotFound:
        pass


# ---- the floor of a two-service start -------------------------------------------------------
class TwoServiceFloor:
    """What compose does for one run of the two-service task, as straight SDK calls: a network
    (with a subnet from `subnets` when given, as termpool's allocator hands one out), the
    sidecar created on it with its service name as alias and started, then the client with
    Floor's options (bench/episodes.py: the same as termpool's direct start) on the network."""

    def __init__(self, client, floor: Floor, side_image: str, host_id: str, subnets: str = "", prefix: int = 28):
        self.docker = client
        self.floor = floor
        self.side_image = side_image
        self.label = {FLOOR_LABEL: host_id}
        self.subnets = ipaddress.ip_network(subnets).subnets(new_prefix=prefix) if subnets else None

    def start(self, workdir: Path) -> None:
        name = "tpdens-" + uuid.uuid4().hex[:10]
        ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=str(next(self.subnets)))]) if self.subnets else None
        network = self.docker.networks.create(f"{name}_default", labels=self.label, ipam=ipam)
        self.docker.containers.create(
            self.side_image, name=f"{name}-side", labels=self.label, **self._on(network.name, "side")
        ).start()
        run_dir = workdir / name
        for sub in ("sessions", "agent-logs"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.floor.create_start(name, run_dir, **self._on(network.name, "client"))

    def _on(self, network: str, alias: str) -> dict:
        """create() options joining the network under the service's name, as compose does."""
        endpoint = self.docker.api.create_endpoint_config(aliases=[alias])
        return {"network": network, "networking_config": {network: endpoint}}

    def remove_all(self) -> None:
        label = {"label": f"{FLOOR_LABEL}={self.label[FLOOR_LABEL]}"}
        for container in self.docker.containers.list(all=True, filters=label, sparse=True):
            _quietly(lambda c=container: c.remove(force=True, v=True))
        for network in self.docker.networks.list(filters=label):
            _quietly(network.remove)
