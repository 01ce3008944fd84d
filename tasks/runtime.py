"""What every job module of a worker process shares: the state store, Redis calls that wait
out an outage, and run teardown."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from environments import forking, lifecycle
from poolcore import failures
from poolcore.config import settings
from poolcore.state import FULL, UNREACHABLE, Store

OUTAGE_SECONDS = 60.0  # a Redis call that must land is tried again this long while Redis cannot take it
T = TypeVar("T")
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def store() -> Store:
    return Store.connect(settings())


def through_outage(call: Callable[[], T], what: str) -> T:
    """call(), again while Redis cannot be reached (an outage, a partition) or refuses writes
    (full: maxmemory) for up to OUTAGE_SECONDS: for the Redis calls of work that is done or under way on this host, which
    nothing else would finish (a job's end, a teardown's bookkeeping). Every such call must be
    safe to make twice."""
    deadline, delay = time.monotonic() + OUTAGE_SECONDS, 0.25
    while True:
        try:
            return call()
        except (*UNREACHABLE, FULL) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: Redis not reached yet (%s); trying again", what, exc)
        time.sleep(delay)
        delay = min(2 * delay, 2.0)


def subnet_taker(run_id: str) -> Callable[[int], list[str]]:
    """lifecycle.start's `subnets`: blocks of this host's run-network range for the run's
    networks, held in Redis under the run until its teardown (remove_env) or the reconcile
    gives them back. HOST_NETWORKS_EXHAUSTED (429) when too few are free."""

    def take(count: int) -> list[str]:
        cfg = settings()
        blocks = cfg.run_subnets
        taken = store().take_subnets(cfg.host_id, run_id, count, blocks.count)
        if taken is None:
            in_use, reserved = store().subnets_in_use(cfg.host_id)
            raise failures.NetworksExhausted(
                f"host {cfg.host_id} has no free network for run {run_id}: it needs {count}, and {in_use} of the"
                f" {blocks.count} /{blocks.prefix} blocks of RUN_SUBNETS {blocks.cidr} are held by live runs"
                f" ({reserved} reserved: in use outside termpool); close runs or widen RUN_SUBNETS"
            )
        return [blocks.subnet(i) for i in taken[:count]]

    return take


def remove_env(run_id: str, env: dict) -> int:
    """Remove a run's containers and networks (its warm container's too) and its socket folder
    (whatever else fails: it is this host's file, and nothing else would remove it); then the
    committed fork images that no other run needs (forking.py)."""
    try:
        direct = env.get("mode") == "direct"  # started without compose: containers only
        removed = lifecycle.remove_run_resources(run_id, env.get("project", ""), containers_only=direct)
        if not direct:  # its networks are gone: their blocks may go to another run
            host = settings().host_id
            through_outage(lambda: store().give_back_subnets(host, run_id), f"run {run_id}'s subnets given back")
        if env.get("warm_id"):  # a spare: started without compose
            removed += lifecycle.remove_run_resources(env["warm_id"], containers_only=True)
            through_outage(lambda: store().warm_forget(env["warm_id"]), f"run {run_id}'s warm container forgotten")
    finally:
        lifecycle.remove_ctl_dir(env.get("ctl_dir", ""))
    for image in forking.remove_images(store().drop_images(run_id)):
        store().forget_image(image)
    return removed
