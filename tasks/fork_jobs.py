"""The fork job: K new runs from a live one, on its host (docs/http-api.md, "Forking a run").

The facade has placed the children already (Store.place_fork: "starting", a slot each). This
job commits every service of the source, starts each child's services from those images,
carries the shell sessions over and makes the children ready. All or nothing: when anything
fails, every child is closed and torn down and the images go with the last run needing them;
a worker killed mid-fork leaves children whose fork job has ended, which the reconcile closes
(close_stale_forks), and labelled images nobody needs, which it removes (remove_orphan_images).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import docker.errors
from celery import shared_task

from environments import checkpoints, forking, lifecycle
from environments.session_helper import CTL_SOCKET, prepare_container, start_server
from poolcore import failures
from poolcore.config import settings
from poolcore.state import NO_FAILURE, STARTED_STATES
from tasks.job_context import RunNotStarted, artifacts_dir, live_run, recorded_job, run_task_dir, run_timeouts
from tasks.runtime import remove_env, store, subnet_taker

log = logging.getLogger(__name__)

PROCESSES_RESTARTED = "restarted"
PROCESSES_CARRIED = "carried"
STALE_FORK_SECONDS = 60.0  # a child whose fork job was never recorded is closed after this long
CHECKPOINT_PREFIX = "termpool-fork-"  # a fork's checkpoint of its source (environments/checkpoints.py)


@shared_task(name="pool.fork_run", bind=True)
@recorded_job
def fork_run(self, *, host, run_id, job_id, children):
    """The source goes on as it was whatever happens; a failed fork closes its children."""
    made: dict = {}
    try:
        result = _fork(run_id, job_id, host, children, made)
    except BaseException as exc:
        _undo(children, made, f"the fork of {run_id} failed: {failures.cap(str(exc) or type(exc).__name__, 500)}")
        raise
    store().add_children(run_id, result["run_ids"])
    return result


def _fork(run_id: str, job_id: str, host: str, children: list, made: dict) -> dict:
    source = live_run(run_id)
    if source["state"] not in STARTED_STATES or not source.get("env"):
        raise RunNotStarted(f"run {run_id} is {source['state']}: only a started run can be forked")
    env = source["env"]
    containers = forking.service_containers(env)
    names = forking.image_names(run_id, secrets.token_hex(4), containers)
    inherited = store().images_needed(run_id)  # a fork of a fork needs its ancestors' images too
    for child in children:  # before the commit: an image made is always someone's (or an orphan)
        store().need_images(child, [*names.values(), *inherited])
    sids = store().session_ids(run_id)
    captured = forking.capture_sessions(containers[_client_service(env, containers)], sids)
    carry = Carry(name=f"{CHECKPOINT_PREFIX}{secrets.token_hex(4)}", client=_client_service(env, containers))
    try:
        _checkpoint_and_commit(carry, host, containers, names, run_id)
        start = functools.partial(_start_child, source, names, captured, carry)
        with ThreadPoolExecutor(max_workers=len(children), thread_name_prefix="fork") as pool:
            futures = {child: pool.submit(start, child) for child in children}
            for child, future in futures.items():
                made[child] = future.exception() or future.result()
    finally:
        for source_id in carry.sources.values():
            checkpoints.remove(source_id, carry.name)
    errors = [value for value in made.values() if isinstance(value, BaseException)]
    if errors:
        raise errors[0]
    carried = all(carry.carried.get(child) is True for child in children)
    return {
        "run_ids": list(children),
        "processes": PROCESSES_CARRIED if carried else PROCESSES_RESTARTED,
        "processes_reason": "" if carried else carry.why(children),
        "sessions_restarted": [] if carried else sorted(captured),
        "user_msg": source.get("user_msg"),
        "tool_schemas": source.get("tool_schemas"),
    }


@dataclass
class Carry:
    """A fork's process carry: each source service's checkpoint, and per child whether its
    processes were restored (True) or why they were restarted."""

    name: str
    client: str = forking.DIRECT_CLIENT  # the client's service (it alone holds tp-session's lock)
    sources: dict = field(default_factory=dict)  # service -> source container id, once it may have a checkpoint
    reason: str = ""  # why the fork restarts processes ("": it carries them)
    carried: dict = field(default_factory=dict)  # child -> True, or the restore's error

    def why(self, children) -> str:
        left = [self.carried.get(c) for c in children if self.carried.get(c) is not True]
        return self.reason or (str(left[0] or "the child was not started from the checkpoints") if left else "")


def _checkpoint_and_commit(carry: Carry, host: str, containers: dict, names: dict, run_id: str) -> None:
    """Commit the source's services; where this host carries processes, checkpoint each running
    one first, all paused across both (their processes and files are one instant). The first
    checkpoint CRIU refuses makes the whole fork restart processes."""
    if not store().carries_processes(host):
        carry.reason = store().host_info(host).get("fork_processes") or "FORK_PROCESSES is not checked yet"
        forking.commit(containers, names, run_id, host)
        return
    running = {service: c for service, c in containers.items() if c.status == "running"}
    paused = []
    try:
        for container in running.values():
            container.pause()
            paused.append(container)
        for service, container in running.items():
            carry.sources[service] = container.id
            try:
                checkpoints.create(container, carry.name)
            except checkpoints.CheckpointFailed as exc:
                log.warning("fork of %s restarts processes: %s", run_id, exc)
                carry.reason = _named(service, exc)
                break
        for container in paused:  # a failed checkpoint may have thawed its container
            container.reload()
            if container.status == "running":
                container.pause()
        forking.commit(containers, names, run_id, host, pause=False)
    finally:
        for container in paused:
            container.reload()
            if container.status == "paused":
                container.unpause()


def _named(service: str, exc: Exception) -> str:
    """A checkpoint's or restore's error, naming the compose service it was of."""
    return f"service {service!r}: {exc}" if service != forking.DIRECT_CLIENT else str(exc)


def _client_service(env: dict, containers: dict) -> str:
    """The key of the run's client container among its services."""
    return next((svc for svc, c in containers.items() if c.name == env["client"]), forking.DIRECT_CLIENT)


def _start_child(source: dict, names: dict, captured: dict, carry: Carry, child_id: str) -> dict:
    """One child's services from the committed images (its processes from the checkpoint where
    the fork carries them), its tool server, its sessions; ready."""
    child = store().require_run(child_id)
    task_dir = run_task_dir(child)
    cfg = settings()
    force_compose = source["env"].get("mode") == "compose"
    disk_limit = int(source.get("disk_limit") or 0)  # a child is held to its source's disk limit
    env, container = lifecycle.start(
        child,
        task_dir,
        artifacts_dir(child),
        cfg,
        run_timeouts(child).reset_session,
        force_compose,
        disk_limit=disk_limit,
        images=names,
        starter=None if carry.reason else functools.partial(_restore, carry, child_id),
        subnets=subnet_taker(child_id),
    )
    carried = carry.carried.get(child_id) is True
    try:
        if not env.booted:
            prepare_container(container, serve=bool(env.ctl_dir))
        kinds = {sid: store().session(source["run_id"], sid).get("kind", "") for sid in captured}
        if carried:
            forking.refresh_sessions(container, captured)
            if env.ctl_dir:  # a new tool server: the restored one's socket file is not the one it made
                forking.stop_restored_server(container, f"{CTL_SOCKET}.lock")
                Path(lifecycle.ctl_socket(env.to_dict())).unlink(missing_ok=True)  # else it quits within 1 s
                start_server(container)  # takes the old one's lock once it is gone
            restarted = []
        else:
            ctl = lifecycle.ctl_socket(env.to_dict())
            restarted = forking.restart_sessions(container, ctl, captured, kinds, cfg.session_output_limit)
        store().copy_sessions(source["run_id"], child_id, set(restarted))
    except BaseException:
        remove_env(child_id, env.to_dict())
        raise
    fields = {
        "env": env.to_dict(),
        "user_msg": source.get("user_msg"),
        "tool_schemas": source.get("tool_schemas"),
        "processes": PROCESSES_CARRIED if carried else PROCESSES_RESTARTED,
        "processes_reason": "" if carried else carry.why([child_id]),
        "forked_at": time.time(),
        "disk_limit": disk_limit,
        **NO_FAILURE,
    }
    if not store().set_state_if_live(child_id, "ready", **fields):
        remove_env(child_id, env.to_dict())  # closed while it was being made: its close found nothing yet
    return env.to_dict()


def _restore(carry: Carry, child_id: str, containers: dict, restart) -> None:
    """lifecycle.start's starter: each of the child's containers (in start order) from its
    source's checkpoint; a service whose source was not running stays created. When a restore
    fails, the services restored so far are stopped and `restart()` starts the child afresh
    (its sessions are then restarted), the reason kept: never a half-restored child."""
    restored = []
    for service, container in containers.items():
        if service not in carry.sources:
            continue
        held = (f"{CTL_SOCKET}.lock",) if service == carry.client else ()
        try:
            checkpoints.restore(carry.sources[service], container, carry.name, held=held)
        except checkpoints.CheckpointFailed as exc:
            log.warning("child %s restarts processes: %s", child_id, exc)
            carry.carried[child_id] = _named(service, exc)
            for done in restored:
                _kill(done)
            restart()
            return
        restored.append(container)
    carry.carried[child_id] = True


def _kill(container) -> None:
    try:
        container.kill()
    except docker.errors.APIError as exc:  # its processes ended on their own already
        if exc.status_code != 409:
            raise


def _undo(children: list, made: dict, error: str) -> None:
    """Close every child of a failed fork: containers, slot, record and image references."""
    for child in children:
        env = made.get(child)
        try:
            remove_env(child, env if isinstance(env, dict) else {})
        finally:
            store().release(child, reason="fork_failed")
            store().mark_closed(child)
            store().update_run(child, error=error)


# ---- the reconcile's part -------------------------------------------------------------------
def close_stale_forks(host: str, enqueue_close) -> list[str]:
    """Children still "starting" whose fork job has ended (its worker was killed) or was never
    recorded: released and torn down through `enqueue_close(run_id)`."""
    closed = []
    for run_id in store().live_runs(host):
        run = store().get_run(run_id) or {}
        if not run.get("parent") or run.get("state") != "starting":
            continue
        job = store().get_job(run.get("fork_job", "")) if run.get("fork_job") else None
        ended = job is not None and job.get("state") in ("succeeded", "failed")
        never = job is None and time.time() - float(run.get("created_at") or 0) > STALE_FORK_SECONDS
        if (ended or never) and store().release(run_id, reason="fork_failed", only_state="starting"):
            enqueue_close(run_id)
            closed.append(run_id)
    return closed


def remove_stale_checkpoints(host: str) -> list[str]:
    """Checkpoints of fork sources older than a fork takes (a worker killed mid-fork)."""
    if not store().carries_processes(host):
        return []
    return checkpoints.remove_stale(lifecycle.host_containers(host), CHECKPOINT_PREFIX, STALE_FORK_SECONDS)


def remove_orphan_images(host: str, is_live) -> list[str]:
    """Committed fork images of this host that no live run needs (a crash between commit and
    teardown): removed, with their reference sets."""
    orphans = [image for image in forking.host_images(host) if not any(map(is_live, store().image_users(image)))]
    for image in forking.remove_images(orphans):
        store().forget_image(image)
    return orphans
