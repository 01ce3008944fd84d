"""The disk-limit fault: one extra run, beside the scenario's episodes, writes past the
service's CONTAINER_DISK_LIMIT. It must end with RUN_DISK_LIMIT within a few check periods
and leave no container, while the episodes go on untouched."""

from __future__ import annotations

import time

import docker

from chaos.service import BASE_TASK, Service
from termpool.client import Pool, RunDiskLimit, TermpoolError

LIMIT_MB = 256  # the service's CONTAINER_DISK_LIMIT in this scenario
CHECK_SECONDS = 2.0  # its DISK_CHECK_SECONDS
ENV = (("CONTAINER_DISK_LIMIT", f"{LIMIT_MB}m"), ("DISK_CHECK_SECONDS", f"{CHECK_SECONDS:g}"))
END_LIMIT = 30.0  # seconds the hog's run gets to be ended after its write
WRITE = f"head -c {2 * LIMIT_MB}M /dev/zero > /tmp/fill; ls -l /tmp/fill"


def write_past_limit(service: Service) -> dict:
    """Allocate and reset a run of the base task, write twice the limit in it, then call it
    until a call answers RUN_DISK_LIMIT; what happened, for the report."""
    info: dict = {"action": f"one extra run writes {2 * LIMIT_MB} MiB, limit {LIMIT_MB} MiB"}
    with Pool(service.url, timeout=120, retries=0) as pool:
        lease = pool.allocate("chaos-disk-hog")
        lease.reset(BASE_TASK, instruction="fill the disk")
        info["run"] = lease.id
        lease.exec(WRITE, timeout=60)
        written = time.monotonic()
        info.update(_wait_ended(lease, written))
    info["containers_left"] = _containers(lease.id)
    return info


def _wait_ended(lease, written: float) -> dict:
    """Poll the run with a tool call each second until it answers RUN_DISK_LIMIT."""
    while time.monotonic() - written < END_LIMIT:
        try:
            lease.exec("true")
        except RunDiskLimit as ended:
            return {"ended_code": ended.code, "ended_after_s": round(time.monotonic() - written, 1)}
        except TermpoolError as other:  # the call in flight when the run ended, say
            return {"ended_code": other.code, "ended_after_s": round(time.monotonic() - written, 1)}
        time.sleep(1.0)
    return {"ended_code": None, "ended_after_s": None}


def _containers(run_id: str, wait: float = 30.0) -> int:
    """The run's containers still there once its teardown has had `wait` seconds."""
    client = docker.from_env(timeout=60)
    deadline = time.monotonic() + wait
    while True:
        left = client.containers.list(all=True, filters={"label": f"termpool.run={run_id}"})
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.5)
