"""The texts of a refused allocation: a full pool, a host short of disk, a tenant's quota.
The facade's two faces answer them (app/pool_api.py, app/runs_api.py), and so do the engine's
own refusals."""

from __future__ import annotations

REASONS_SHOWN = 3  # of a task's one-per-host reasons, in a capacity message


def capacity_message(task_key: str, code: str, one_per_host: tuple = (), reason: str = "") -> str:
    """The error text of a full pool; one_per_host: why the task allows one live run per host;
    reason: why each host is short of disk (HOST_DISK_LOW), or which tenant limit was met."""
    if code == "TENANT_QUOTA_EXCEEDED":
        return tenant_quota_message(reason)
    if code == "HOST_DISK_LOW":
        return f"no worker host takes new runs for task {task_key!r}: every one is short of disk ({reason})"
    if code == "WORKERS_DOWN":
        return f"no worker host takes new runs for task {task_key!r}: none is live and not draining"
    if not one_per_host:
        limit = "WORKER_MAX_TASKS" if code == "TASK_SLOTS_EXHAUSTED" else "WORKER_MAX_RUNS_PER_TASK"
        return f"no capacity for task {task_key!r}: {limit} reached"
    why = "; ".join(one_per_host[:REASONS_SHOWN])
    if len(one_per_host) > REASONS_SHOWN:
        why += f"; and {len(one_per_host) - REASONS_SHOWN} more"
    if code == "RUN_SLOTS_EXHAUSTED":
        return (
            f"no capacity for task {task_key!r}: it allows one live run per host ({why}); every host "
            "taking runs holds one already (live, or its teardown still running) or is full"
        )
    return (
        f"no capacity for task {task_key!r}: WORKER_MAX_TASKS reached on every host without one of "
        f"its runs (it allows one live run per host: {why})"
    )


def tenant_quota_message(reason: str) -> str:
    """A tenant's refusal (docs/tenants.md): its own max_runs, or other tenants' reservations."""
    if reason == "reserved":
        return "no capacity for this tenant: the free run slots left are reserved for other tenants (reserved_runs)"
    return "this tenant's max_runs live runs are live already; close one or wait"
