"""What a scenario left behind, and the harness's own cleanup afterwards (so the next
scenario, and the shared machine, start clean whatever the service failed to remove)."""

from __future__ import annotations

import shlex
import shutil
import time

import docker
import docker.errors
import redis

from chaos import faults
from chaos.service import Service
from environments.session_helper import HELPER_DIR_SUFFIX, VERSIONS_DIR
from poolcore.state import Store
from termpool.client import TermpoolError

HOST_LABEL = "termpool.host"  # the label termpool puts on every container and network it makes
RUN_LABEL = "termpool.run"
SETTLE_TIMEOUT = 90.0


def _docker(service: Service):
    """The Docker engine the service's workers use (DOCKER_HOST in its settings: a second
    daemon for docker-restart, else the machine's)."""
    return docker.from_env(environment=service.env, timeout=60)


def containers(service: Service) -> list:
    # read while the stack runs: a spare or a run may go between the listing and its inspect
    mine = {"label": f"{HOST_LABEL}={service.host_id}"}
    return _docker(service).containers.list(all=True, filters=mine, ignore_removed=True)


def warm_spares(service: Service) -> set[str]:
    """Run labels of the host's containers that the warm pool still holds (pooled or
    starting): spares, not leftovers (a clean stop removes them)."""
    try:
        store = Store(service.redis)
        labels = {c.labels.get(RUN_LABEL, "") for c in containers(service)}
        return {run for run in labels if run.startswith("warm-") and store.warm_known(run)}
    except redis.RedisError:
        return set()


def left_behind(service: Service) -> list:
    """The host's containers that are not warm spares."""
    spares = warm_spares(service)
    return [c for c in containers(service) if c.labels.get(RUN_LABEL, "") not in spares]


def networks(service: Service) -> list:
    return _docker(service).networks.list(filters={"label": f"{HOST_LABEL}={service.host_id}"})


def capacity(service: Service) -> dict | None:
    """Slots held and closes pending: /status when the facade answers, else straight from the
    state store (the facade may be the process that died)."""
    try:
        pool = service.client.status()
        return {"runs": pool.get("total_active_runs", 0), "closes": pool.get("pending_closes", 0), "via": "/status"}
    except (TermpoolError, KeyError, AttributeError):
        pass
    try:
        status = service.store().host_status(service.host_id)
        return {"runs": status["total_active_runs"], "closes": status["pending_closes"], "via": "redis"}
    except redis.RedisError:
        return None


def settle(service: Service) -> float:
    """Wait (up to SETTLE_TIMEOUT s) until no run holds a slot, no close is pending and no
    container of the host but the warm pool's spares is left; returns the seconds waited. A stack that exited is not
    waited for: nothing will clean up after it."""
    start = time.monotonic()
    while service.alive() and time.monotonic() - start < SETTLE_TIMEOUT:
        held = capacity(service)
        if held and held["runs"] == 0 and held["closes"] == 0 and not left_behind(service):
            break
        time.sleep(1)
    return round(time.monotonic() - start, 1)


def redis_locks(service: Service) -> list[str]:
    """Build locks still held (a dead holder's lock should be gone within LOCK_TTL)."""
    try:
        return sorted(Store(service.redis).held_locks())
    except redis.RedisError:
        return []


def measure(service: Service) -> dict:
    """Leftovers while the stack is still up (after settle): containers, networks, socket dirs,
    held capacity, locks; the warm pool's spares are listed apart."""
    held = capacity(service)
    spares = warm_spares(service)
    return {
        "containers": [c.name for c in left_behind(service)],
        "warm_spares": sorted(spares),  # not counted: the warm pool holds them
        "networks": [n.name for n in networks(service)],
        "socket_dirs": socket_dirs(service, spares),
        "slots_held": None if held is None else held["runs"],
        "closes_pending": None if held is None else held["closes"],
        "capacity_via": None if held is None else held["via"],
        "redis_locks": redis_locks(service),
    }


def socket_dirs(service: Service, spares: set[str]) -> list[str]:
    """A run's socket folder or the helper folder beside it (<folder>.bin), not a pooled
    spare's; not the helper versions every run links to (kept by design), nor the workers'
    containment lock file."""
    return sorted(
        p.name
        for p in service.socket_dir.iterdir()
        if p.is_dir() and p.name != VERSIONS_DIR and p.name.removesuffix(HELPER_DIR_SUFFIX) not in spares
    )


def temp_files(service: Service) -> list[str]:
    """termpool-* files and folders the stack left in its TMPDIR once stopped (the beat
    schedule file is meant to persist and is not counted)."""
    return sorted(
        p.name
        for p in service.tmpdir.iterdir()
        if p.name.startswith("termpool-") and not p.name.startswith("termpool-beat-")
    )


def packet_rules(service: Service) -> list[str]:
    """This service's partition rules still in place (`iptables -S` lines carrying its tag);
    none where iptables is missing or not ours to read."""
    if shutil.which("iptables") is None:
        return []
    tag = f"--comment {faults.partition_tag(service)}"
    lines = []
    for chain in ("INPUT", "OUTPUT"):
        listing = faults.iptables("-S", chain)
        lines += [line for line in listing.stdout.splitlines() if tag in line] if listing.returncode == 0 else []
    return lines


def count(left: dict) -> int:
    total = 0
    for key in ("containers", "networks", "socket_dirs", "redis_locks", "temp_files", "processes", "packet_rules"):
        total += len(left.get(key) or [])
    total += (left.get("slots_held") or 0) + (left.get("closes_pending") or 0)
    return total


def cleanup(service: Service) -> dict:
    """Remove whatever the stack left (after it stopped): containers, networks, the images the
    harness built, the scenario's folders. Returns what had to be removed."""
    removed = {"containers": 0, "networks": 0, "images": 0}
    for container in containers(service):
        try:
            container.remove(force=True, v=True)
            removed["containers"] += 1
        except docker.errors.NotFound:
            pass
    for network in networks(service):
        try:
            network.remove()
            removed["networks"] += 1
        except docker.errors.NotFound:
            pass
    for image in service.images:
        try:
            _docker(service).images.remove(image, force=True)
            removed["images"] += 1
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError:
            pass  # in use by a container that is being removed: harmless, reported by count
    removed["containment"] = _remove_containment(service)
    # The partition removes its rules itself; this is the backstop for a harness cut short.
    rules = packet_rules(service)
    for line in rules:
        faults.iptables(*shlex.split(line.replace("-A ", "-D ", 1)))
    removed["packet_rules"] = len(rules)
    shutil.rmtree(service.workdir, ignore_errors=True)
    return removed


def _remove_containment(service: Service) -> bool:
    """The stack's packet-filter rules (its workers installed them; they outlive a stop)."""
    from environments import containment
    from poolcore.config import load_settings

    try:
        containment.remove(load_settings(service.env))
        return True
    except Exception:
        return False  # no iptables here (not root): the workers installed nothing either
