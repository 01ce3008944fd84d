"""Queue naming, routing and the Celery app's shared configuration.

Imported by both sides: the facade builds its Celery app (to send jobs) from `make_celery`, the
workers build theirs from it too and add their job modules and the beat schedule
(tasks/celery_app.py). Nothing here imports worker code.

Queues are named per worker host and kind of work: ``termpool.<host>.<kind>``. A run's jobs
always go to the queues of the host its containers live on, so routing reads the ``host``
keyword every pool job carries. Reaping goes to the shared ``termpool.maintenance`` queue.
"""

from __future__ import annotations

import functools
import logging
import threading

from celery import Celery
from kombu import Queue

from poolcore import priorities
from poolcore.config import QUEUE_KINDS, Settings
from poolcore.state import connection

log = logging.getLogger(__name__)

MAINTENANCE_QUEUE = "termpool.maintenance"
DEFAULT_LEVEL = priorities.level(priorities.DEFAULT)
MONITOR_POLL = 5.0  # seconds between two looks for a listening monitor (Flower asks as often)

# Which kind of queue each job (Celery task name) is consumed from.
JOB_KINDS = {
    "pool.ensure_image": "build",
    "pool.prebuild_task": "build",
    "pool.start_run": "lifecycle",
    "pool.fork_run": "lifecycle",
    "pool.refill_warm": "lifecycle",
    "pool.start_warm": "lifecycle",
    "pool.size_warm": "lifecycle",
    "pool.exec_tool": "exec",
    "pool.run_command": "exec",
    "pool.put_archive": "exec",
    "pool.get_archive": "exec",
    "pool.evaluate": "eval",
    "pool.close_run": "teardown",
    "pool.reconcile": "teardown",
    "pool.check_disks": "teardown",
    "pool.release_run": "teardown",
    "pool.episode_failed": "teardown",
}


def queue_name(host: str, kind: str) -> str:
    return f"termpool.{host}.{kind}"


def queue_kind(queue: str, host: str) -> str | None:
    """The kind of one of `host`'s queues; None for any other queue."""
    head, _, kind = queue.rpartition(".")
    return kind if head == f"termpool.{host}" and kind in QUEUE_KINDS else None


def consumed_kinds(app, host: str) -> set[str]:
    """The kinds of `host`'s queues a worker of `app` consumes (a Celery worker's selection)."""
    return {queue_kind(name, host) for name in app.amqp.queues.consume_from} - {None}


# Kinds whose messages are taken without an acknowledgement. Their jobs are acked on receipt
# anyway (task_acks_late=False) and run in threads at once (no prefetch), so an ack protects
# nothing there; lost work is recovered from the job records (tasks/lost_jobs.py). A build's
# prefork child that dies mid-build gets its message sent again (retry_on_worker_lost: a new
# message, whatever the ack).
UNACKED_KINDS = frozenset(QUEUE_KINDS) - {"build"}


def host_queues(host: str) -> list[Queue]:
    return [Queue(queue_name(host, kind), no_ack=kind in UNACKED_KINDS) for kind in QUEUE_KINDS]


def route_job(name, args, kwargs, options, task=None, **kw):
    """Explicit route: pool jobs go to their host's queue of their kind, at the default
    priority unless sent with their run's (a sender's option wins over the route's)."""
    kind = JOB_KINDS.get(name)
    if kind is None:
        return {"queue": MAINTENANCE_QUEUE, "priority": DEFAULT_LEVEL}
    host = (kwargs or {}).get("host")
    if not host:
        raise ValueError(f"{name} needs a host to be routed")
    return {"queue": _queue(queue_name(host, kind)), "priority": DEFAULT_LEVEL}


@functools.lru_cache(maxsize=1024)
def _queue(name: str) -> Queue:
    """One Queue entity per queue name, not one per message (kombu binds and checks each)."""
    return Queue(name)


def make_celery(cfg: Settings, include: list[str] | None = None) -> Celery:
    """The Celery app for `cfg`: broker, queues, routes and the delivery rules both sides share.
    The workers pass their job modules in `include`; the facade sends jobs by name."""
    # No result backend: job records in the state store are the results (see below). With a
    # Redis backend the sender also subscribes to each task's result channel (a SUBSCRIBE and
    # an UNSUBSCRIBE per job) and every worker thread builds its own backend client.
    app = Celery("termpool", broker=connection.broker_url(cfg), backend=None, include=include or [])
    app.conf.update(
        task_queues=host_queues(cfg.host_id) + [Queue(MAINTENANCE_QUEUE, no_ack=True)],
        task_create_missing_queues=False,
        task_default_queue=MAINTENANCE_QUEUE,
        task_routes=(route_job,),
        task_serializer="json",
        accept_content=["json"],
        result_expires=None,  # no results kept, so no daily backend_cleanup task from beat
        # A tool call must never run twice: ack on receipt, one message per worker slot.
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        # Lost work (tasks/lost_jobs.py). Acked when it starts, a job is never replayed after
        # its worker dies (Redis keeps no unacked copy: ack_emulation below); and without
        # prefetch a worker holds no message it has not started. A build whose prefork child
        # dies is sent again at once, once; everything else lost is recovered by
        # tasks/lost_jobs.py.
        worker_disable_prefetch=True,
        task_annotations={
            "pool.ensure_image": {"retry_on_worker_lost": True, "max_retries": 1, "default_retry_delay": 0}
        },
        # Job records in the state store (queued/started/finished, result, error, keyed by the
        # Celery task id) are what clients poll; storing every result and STARTED state in the
        # backend as well would cost two more Redis writes and publishes per tool call.
        task_ignore_result=True,
        task_track_started=False,
        # Task events are for a monitor. Flower asks every worker to send them (Celery's
        # enable_events broadcast, every few seconds), so with TASK_EVENTS=monitor workers
        # start without and publish nothing while no monitor listens; `always` sends them
        # from the start. Sent events (per job, from whoever sends it) show queued jobs and
        # their queue: with `monitor` only while a monitor announces itself (follow_monitor).
        worker_send_task_events=cfg.task_events == "always",
        task_send_sent_event=cfg.task_events == "always",
        # Redis away (restart, failover): every worker, its queue consumers and beat keep
        # reconnecting until it is back, however long that takes, instead of exiting.
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        broker_channel_error_retry=True,
        # Sending a job waits out an unreachable Redis as the state store's commands do
        # (REDIS_OUTAGE_SECONDS): tries 0.5 s apart, then 2 s apart, about that long in all.
        task_publish_retry=True,
        task_publish_retry_policy=_publish_retry_policy(cfg.redis_outage_seconds),
        # Priorities (poolcore/priorities.py): each job is sent with its run's class, and jobs
        # with none (the pool's own: warm pool, reconcile) get the default class (route_job).
        # kombu keeps one Redis list per priority step of a queue and a worker's BRPOP names
        # them highest step first, so it takes the highest class waiting; since a worker only
        # asks for a message when a slot is free (worker_disable_prefetch), that is the
        # order in which queued jobs start. Store.queue_depths sums the lists.
        # A Sentinel deployment adds the primary's name (connection.py): kombu asks the
        # sentinels for the primary at each connection, so a failover is one more reconnect.
        # No ack emulation (kombu's copy of every message in Redis' unacked hash and index until
        # its ack, restored after visibility_timeout): with acks on receipt it guards only the
        # instant between BRPOP and the ack, and costs MULTI ZADD HSET EXEC (or, for a no_ack
        # queue, MULTI ZREM HDEL EXEC) per message plus the periodic restore scan. Lost work
        # is recovered from the job records (tasks/lost_jobs.py) instead.
        broker_transport_options={
            "ack_emulation": False,
            "priority_steps": priorities.STEPS,
            "sep": priorities.SEP,
            **connection.broker_transport_options(cfg),
        },
        worker_hijack_root_logger=False,
    )
    return app


def _publish_retry_policy(outage: float) -> dict:
    """kombu's retry policy for publishing (waits of 0, 0.5, 1, 1.5, then 2 s) spanning about
    `outage` seconds."""
    waits, tries = 0.0, 0
    while waits < outage:
        tries += 1
        waits += min(0.5 * (tries - 1), 2.0)
    return {"max_retries": tries, "interval_start": 0, "interval_step": 0.5, "interval_max": 2.0}


def follow_monitor(app: Celery, cfg: Settings, store) -> threading.Event | None:
    """With TASK_EVENTS=monitor, publish task-sent events only while a monitor announces
    itself in the state store (tasks/flower.py does): a daemon thread looks every
    MONITOR_POLL seconds, through `store`, one that does not wait out a Redis outage (the
    next look comes soon enough). A process calls this once, after any fork. Returns the
    event that stops the thread (None: no thread)."""
    if cfg.task_events != "monitor":
        return None
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            try:
                app.conf.task_send_sent_event = store.monitor_listening()
            except Exception as exc:  # Redis away: keep the last answer, look again later
                log.debug("could not look for a monitor: %s", exc)
            stop.wait(MONITOR_POLL)

    threading.Thread(target=follow, daemon=True, name="termpool-monitor-follower").start()
    return stop
