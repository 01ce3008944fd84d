"""Disk arithmetic shared by the workers and the facade: a run's disk limit, when a run is past
it, and when a host is short of free space (no Docker here: environments/disk_usage.py measures).
"""

from __future__ import annotations

from dataclasses import dataclass

from poolcore.config import DiskFloor

MIB = 1 << 20


def run_limit(setting: int, task_mb: int | None) -> int:
    """Bytes a run may write: the lower of CONTAINER_DISK_LIMIT (0: none) and the task's own
    request (Harbor's storage_mb; None: none); 0 when neither sets one."""
    limits = [value for value in (setting, (task_mb or 0) * MIB) if value > 0]
    return min(limits) if limits else 0


def over_limit(used: int, limit: int) -> bool:
    return limit > 0 and used > limit


def limit_message(run_id: str, used: int, limit: int) -> str:
    return (
        f"run {run_id} holds {used / MIB:.0f} MiB on disk (its containers' writable layers, volumes and "
        f"folders), over its limit of {limit / MIB:.0f} MiB: it was ended and its containers removed"
    )


@dataclass(frozen=True)
class Space:
    """Free and total bytes of the file system holding one of a host's disk roots."""

    root: str  # what it holds: "docker" (Docker's data root) or "output" (TBENCH_OUTPUT_ROOT)
    path: str
    free: int
    total: int


def shortage(spaces: list[Space], floor: DiskFloor) -> str:
    """Why the host takes no new runs ('' when it has room): each root under HOST_DISK_MIN_FREE."""
    short = [s for s in spaces if floor.short_of(s.free, s.total)]
    return "; ".join(
        f"{s.root} root {s.path} has {s.free / (1 << 30):.1f} GiB free of {s.total / (1 << 30):.1f} GiB, "
        f"under HOST_DISK_MIN_FREE={floor}"
        for s in short
    )
