"""Lost work: a job whose worker process died is retried once or failed with WORKER_LOST.

A job is lost in one of two ways:

* A prefork child dies (the build pool). The worker's main process sees it at once (Celery's
  WorkerLostError): Celery sends pool.ensure_image again once (task_retry_on_worker_lost,
  celery_app.py), and a second loss reaches `task_failure` here, which fails the job. A child
  killed for its hard time limit reaches `task_failure` too (code TIMEOUT).
* A whole worker process dies (kill -9, OOM): nothing in it can act. Every worker process
  registers itself under a random token with the facts needed to check its pid, beats every
  SCAN_SECONDS, and lists the jobs it runs while it runs them (job_context.recorded_job). Every worker
  process of the host scans the others on each beat; one whose pid is gone (same pid
  namespace: at once, and only then: a live pid is a hung process, not a dead one) or whose
  beat is older than state.NODE_TTL (elsewhere, judged only after NODE_TTL seconds of unbroken
  contact with Redis, so an outage or partition kills nobody) is dead, and
  each job it held is recovered exactly once (Store.take_lost_job): sent again if it may be
  (below), else failed with WORKER_LOST. A restarted worker scans at once when it is ready.

Retried once, on whichever worker process of that kind takes the message: image builds,
starts (the retried pool.start_run first removes what the lost one had made), closes, and
evaluations whose tests had not started (the run was not yet "evaluating"). Never retried: tool
calls and commands (they may have had effects; the run stays usable; a lost command's processes
are killed) and evaluations under way. The
retry is the lost step's own message, rebuilt with Celery's public `signature_from_request`
(so the rest of an episode's chain and its error callback ride along) and counted in the
message's `retries`; a step lost on its retry fails.

A worker takes a message off its queue before its job is listed (acks on receipt, no unacked
copy kept), so a process killed between the two loses the message with nothing listed. For a
close that would leave its run closing, with its containers, until the reaper sends it again
(twice the close timeout later, tasks/close_recovery.py). Closes are idempotent, so a teardown
worker that starts sends again at once the close of every closing run of its host whose close
no process runs and whose message cannot be waiting in the queue.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time

from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.signals import task_failure, task_retry, worker_ready, worker_shutdown

from environments import commands
from environments.docker_client import docker_client
from poolcore import failures, processes
from poolcore.config import settings
from poolcore.dispatch import EPISODE_FAILED_TASK
from poolcore.queues import consumed_kinds
from poolcore.state import NODE_TTL
from tasks import close_recovery
from tasks.runtime import store

log = logging.getLogger(__name__)

SCAN_SECONDS = 3.0
MAX_RETRIES = 1
# Steps that may run again after their process died (see the module docstring).
RETRY_ON_LOST = {"pool.ensure_image", "pool.start_run", "pool.evaluate", "pool.close_run", "pool.release_run"}
# What a prefork child's death is called when Celery reports it.
CHILD_LOSS_CODES = {WorkerLostError: "WORKER_LOST", TimeLimitExceeded: "TIMEOUT"}

# This worker process; made at import, before the prefork pool forks, so its children share it.
TOKEN = secrets.token_hex(8)
_stop = threading.Event()


# ---- which process runs which job ---------------------------------------------------------
# The jobs wrapper (job_context.recorded_job) lists a job under this process as it begins (Store.begin_job,
# with resendable()) and takes it off as it ends (job_finished / job_left).
def resendable(task) -> dict | None:
    """How to send the running step again if its process dies: its message as a signature
    (Celery rebuilds retries the same way); None for steps never sent again."""
    if task.name not in RETRY_ON_LOST:
        return None
    signature = dict(task.signature_from_request())
    try:
        json.dumps(signature)
    except (TypeError, ValueError):
        log.warning("%s cannot be sent again if its process dies: its request is not JSON", task.name)
        return None
    return signature


# ---- a prefork child died: Celery tells the main process ----------------------------------
@task_retry.connect
def _child_lost_retried(sender=None, request=None, reason=None, **_):
    exc = getattr(reason, "exc", None)
    job_id = ((request and request.kwargs) or {}).get("job_id")
    if isinstance(exc, WorkerLostError) and job_id:
        store().job_left(job_id, TOKEN)
        error = f"a process of worker {request.hostname} died: {exc}"
        store().job_lost_retry(job_id, getattr(sender, "name", "") or "", error, retries=request.retries + 1)


@task_failure.connect
def _child_lost_failed(sender=None, exception=None, kwargs=None, **_):
    code = CHILD_LOSS_CODES.get(type(exception))
    job_id = (kwargs or {}).get("job_id")
    if code is None or not job_id:
        return  # an ordinary failure: the job's own wrapper recorded it
    store().job_left(job_id, TOKEN)
    job = store().get_job(job_id)
    if job:
        # Celery calls the step's error callbacks itself (an episode settles there).
        _fail(job, f"a process of worker {job.get('node')} was lost while running this job: {exception}", code)


# ---- a whole worker process died: the others notice ---------------------------------------
def dead(token: str, facts: dict, judge_beats: bool) -> bool:
    """Whether another worker process is dead (module docstring)."""
    if processes.visible(facts):
        return processes.known_dead(facts)
    return judge_beats and not store().worker_alive(token)


def scan(app, host: str, judge_beats: bool = True) -> list[str]:
    """Recover the jobs of this host's dead worker processes; return the jobs recovered."""
    recovered = []
    for token, facts in store().host_workers(host).items():
        if token == TOKEN or not dead(token, facts, judge_beats):
            continue
        for job_id in store().worker_jobs(token):
            if store().take_lost_job(token, job_id):
                _recover(app, job_id, facts.get("node", token))
                recovered.append(job_id)
        store().forget_worker(host, token)
    return recovered


def _recover(app, job_id: str, node: str) -> None:
    job = store().get_job(job_id)
    if not job or job.get("state") not in ("queued", "running"):
        return
    error = f"worker {node} was lost while running this job"
    retry_with = _retry_signature(job)
    if retry_with is None:
        _fail(job, error, "WORKER_LOST")
        _settle_episode(app, job)
        return
    retries = int(retry_with.get("options", {}).get("retries") or 0) + 1
    attempts = store().job_lost_retry(job_id, retry_with.get("task") or "", error, retries=retries)
    app.signature(retry_with).apply_async(retries=retries)
    log.warning(
        "job %s (%s) was lost with worker %s; sent again (attempt %s)", job_id, retry_with.get("task"), node, attempts
    )


def _retry_signature(job: dict) -> dict | None:
    """The lost step's message, if it may be sent again (see the module docstring)."""
    if not job.get("retry_with"):
        return None
    retry_with = json.loads(job["retry_with"])
    if int(retry_with.get("options", {}).get("retries") or 0) >= MAX_RETRIES:
        return None
    if job.get("kind") == "close":
        return retry_with
    state = (store().get_run(job["run_id"]) or {}).get("state")
    if state in (None, "closing", "closed") or (job.get("kind") == "evaluation" and state == "evaluating"):
        return None
    return retry_with


def _fail(job: dict, error: str, code: str) -> None:
    """Fail the job and put its run back in a state that tells the truth (a tool call's run
    reads as ready again once its job has ended: the sessions live on in the container)."""
    if not store().fail_lost_job(job["job_id"], error, code):
        return
    run_id, kind = job["run_id"], job.get("kind")
    if kind == "start":
        store().set_state_if_live(run_id, "failed", error=error, **failures.fields(code))
    elif kind == "evaluation" and store().transition(run_id, ("evaluating",), "ready"):
        store().update_run(run_id, error=error, **failures.fields(code))
    elif kind == "command":
        _kill_lost_command(job)


def _kill_lost_command(job: dict) -> None:
    """A command lost with its worker is killed (environments/commands.py): nothing would end
    it at its time limit now. Best effort: the run's teardown removes whatever is left."""
    client = ((store().get_run(job["run_id"]) or {}).get("env") or {}).get("client")
    if not client:
        return
    command = commands.Command(command="", marker=job["job_id"], user=(job.get("call") or {}).get("user"))
    try:
        commands.kill(docker_client().api, client, command)
    except Exception as exc:
        log.warning("the processes of lost command job %s could not be killed: %s", job["job_id"], exc)


def _settle_episode(app, job: dict) -> None:
    """A lost step of an episode: its chain's error callback never fires, so send it."""
    run = store().get_run(job["run_id"]) or {}
    start_job = run.get("start_job")
    jobs = store().episode_jobs(start_job) if start_job else []
    if job["job_id"] not in jobs:
        return
    close = next((j for j in jobs if (store().get_job(j) or {}).get("kind") == "close"), "")
    app.send_task(
        EPISODE_FAILED_TASK,
        kwargs={"host": run["host"], "run_id": run["run_id"], "start_job": start_job, "close_job": close},
    )


# ---- a close whose message died with a process before it began ----------------------------
def resend_unbegun_closes(app, host: str) -> list[str]:
    """At a teardown worker's start: send again the close of each closing run of the host whose
    close job no process runs and whose message cannot be waiting (tasks/close_recovery.py; no
    grace: the process that took it is gone). One waiting in a queue that still holds messages
    is left to it, and to the reaper once the queue has drained."""
    return close_recovery.resend(app, host, store().closing_runs(host), grace=0.0)


def _consumes_teardown(worker, host: str) -> bool:
    return "teardown" in consumed_kinds(worker.app, host)


# ---- this process's beat and scan ----------------------------------------------------------
def _watch(app, host: str, facts: dict) -> None:
    contact_since = None  # monotonic: since when every scan reached Redis
    while True:
        try:
            store().worker_beat(host, TOKEN, facts)
            contact_since = contact_since or time.monotonic()
            recovered = scan(app, host, judge_beats=time.monotonic() - contact_since > NODE_TTL)
            if recovered:
                log.warning("recovered jobs of dead worker processes: %s", recovered)
        except Exception:  # Redis away: keep trying
            contact_since = None
            log.exception("lost-job scan failed")
        if _stop.wait(SCAN_SECONDS):
            return


@worker_ready.connect
def _on_worker_ready(sender=None, **_):
    facts = {"node": sender.hostname, **processes.this_process()}
    threading.Thread(
        target=_watch, args=(sender.app, settings().host_id, facts), daemon=True, name="termpool-lost-jobs"
    ).start()
    host = settings().host_id
    if _consumes_teardown(sender, host):
        try:
            sent = resend_unbegun_closes(sender.app, host)
        except Exception:  # Redis away: the reaper sends stale closes again later
            log.warning("could not send again the closes left pending on %s", host, exc_info=True)
            return
        if sent:
            log.warning("sent again the closes of runs left closing on %s: %s", host, sent)


@worker_shutdown.connect
def _on_worker_shutdown(**_):
    _stop.set()
    try:
        store().worker_stopped(TOKEN)
    except Exception as exc:  # Redis away: the liveness key expires by itself
        log.warning("could not mark this worker process stopped: %s", exc)
