"""The least a Flask + Celery + Redis service can be: the stack termpool is built on, with no
Docker and no logic, for bench/stack_floor.py. Flask's documented Celery pattern (a request
enqueues a job and waits for its result), made as lean as termpool's own: no result backend
(the job pushes its result on a Redis list the request pops), messages consumed without
acks and without kombu's ack emulation, no prefetch, one priority step, no rate limits.

    python -m gunicorn -k gthread -w 2 --threads 64 "bench.minimal_stack:create_app()"
    python -m celery -A bench.minimal_stack worker -P threads -c 16 -Q minimal
    python -m celery -A bench.minimal_stack flower

MINIMAL_REDIS_URL names the Redis; MINIMAL_SENT_EVENTS=1 publishes task-sent events, as
termpool's facade does while a monitor (Flower) listens.
"""

from __future__ import annotations

import json
import os

import redis
from celery import Celery
from flask import Flask, jsonify, request
from kombu import Queue

REDIS_URL = os.environ.get("MINIMAL_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = "minimal"

RESULT_TTL = 60

celery = Celery("minimal", broker=REDIS_URL, backend=None)
celery.conf.update(
    task_queues=[Queue(QUEUE, no_ack=True)],
    task_default_queue=QUEUE,
    task_routes={"minimal.job": {"queue": QUEUE}},
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_disable_prefetch=True,
    worker_disable_rate_limits=True,
    task_send_sent_event=os.environ.get("MINIMAL_SENT_EVENTS") == "1",
    broker_transport_options={"priority_steps": [0], "ack_emulation": False},
    broker_connection_retry_on_startup=True,
)
_results = redis.Redis.from_url(REDIS_URL)


def result_key(job_id: str) -> str:
    return f"minimal:result:{job_id}"


@celery.task(name="minimal.job", bind=True)
def job(self, payload: dict) -> None:
    """Nothing but hand back a result: what any job costs, before it does its own work."""
    key = result_key(self.request.id)
    pipe = _results.pipeline(transaction=False)
    pipe.rpush(key, json.dumps({"output": "hello\n", "echo": payload.get("id")}))
    pipe.expire(key, RESULT_TTL)
    pipe.execute()


def create_app() -> Flask:
    app = Flask(__name__)
    store = redis.Redis.from_url(REDIS_URL)

    @app.post("/job")
    def run_job():
        """A blocking job call (a reset, a tool call, an evaluation): enqueue and wait."""
        sent = job.delay(request.get_json())
        popped = store.blpop([result_key(sent.id)], timeout=60)
        if popped is None:
            return jsonify(error="no result within 60 s"), 504
        return popped[1], 200, {"Content-Type": "application/json"}

    @app.post("/touch")
    def touch():
        """A facade-only call (allocate, heartbeat): one Redis write."""
        store.hset(f"minimal:lease:{request.get_json()['id']}", "used", 1)
        return jsonify(ok=True)

    @app.post("/close")
    def close():
        """Release now, tear down later: one Redis write and a job nobody waits for."""
        body = request.get_json()
        store.delete(f"minimal:lease:{body['id']}")
        job.delay(body)
        return jsonify(found=True)

    return app
