"""The opt-in warm pool (WARM_POOL_SIZE): started containers per one-service task and host.

A reset takes one with LPOP, so no container ever serves two runs; the pool refills in the
background on the lifecycle queue. Pooled containers carry their warm id as run label (labels
cannot change later); their warmid key (termpool/state.py) keeps them safe from the reconcile sweep.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from celery import shared_task

from environments import artifacts, lifecycle
from environments.session_helper import prepare_container
from jobs.runtime import remove_env, store
from termpool.config import settings
from termpool.paths import resolve_task_path


def claim(run: dict, host: str, run_path) -> lifecycle.RunEnv | None:
    """A pre-started container of this task, handed to this run alone (LPOP), if one is alive."""
    while True:
        entry = store().warm_claim(host, run["task_meta"]["task_path"], run["run_id"])
        if entry is None:
            return None
        if lifecycle.client_if_running(entry["client"]) is not None:
            run_path = run_path(run, mounts_from=Path(entry["run_dir"]))
            return lifecycle.RunEnv(
                "direct",
                entry["project"],
                entry["client"],
                str(run_path),
                warm_id=entry["warm_id"],
                ctl_dir=entry.get("ctl_dir", ""),
                user=entry.get("user", ""),
            )
        lifecycle.remove_run_resources(entry["warm_id"])  # died while pooled
        lifecycle.remove_ctl_dir(entry.get("ctl_dir", ""))
        store().warm_forget(entry["warm_id"])


@shared_task(name="pool.refill_warm", bind=True)
def refill_warm(self, *, host, task_path, task_name):
    """Top the task's warm pool up to WARM_POOL_SIZE; one refill per task and host at a time."""
    cfg = settings()
    lock = store().warm_lock(host, task_path)  # expires within seconds of its holder's death
    if not lock.acquire():
        return 0
    started = 0
    with lock:
        task_dir = resolve_task_path(cfg.dataset_dir, task_path)
        while store().warm_count(host, task_path) < cfg.warm_pool_size:
            warm_id = "warm-" + secrets.token_hex(8)
            pseudo_run = {"run_id": warm_id, "task_key": task_name, "task_meta": {"task_name": task_name}}
            store().warm_reserve(warm_id, cfg.timeouts.reset_session + 60)
            env, container = lifecycle.start(
                pseudo_run, task_dir, _warm_dir(cfg, warm_id), cfg, cfg.timeouts.reset_session
            )
            try:
                prepare_container(container, serve=bool(env.ctl_dir))
            except BaseException:
                remove_env(warm_id, env.to_dict())
                raise
            store().warm_push(
                host,
                task_path,
                {
                    "warm_id": warm_id,
                    "client": env.client,
                    "project": env.project,
                    "run_dir": str(_warm_dir(cfg, warm_id)),
                    "ctl_dir": env.ctl_dir,
                    "user": env.user,
                },
            )
            started += 1
    return started


def _warm_dir(cfg, warm_id: str) -> Path:
    return artifacts.run_dir(str(cfg.output_root / ".warm"), "pool", "0", warm_id)


# ---- tool calls -----------------------------------------------------------------------------
