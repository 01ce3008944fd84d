"""Prometheus metrics of the facade, served at /metrics.

Two kinds of series:

* Request series (latency histogram, request and error counters), recorded by the process
  that answered. Under gunicorn (several worker processes) they go through prometheus_client's
  multiprocess mode: each process writes its values to files in PROMETHEUS_MULTIPROC_DIR
  (app/gunicorn_conf.py sets that up) and a scrape sums every process's files, so whichever
  worker answers /metrics reports the same totals. Without that variable (flask run, tests
  in one process) they live in the process's memory.
* Pool gauges (live runs, pending closes, queue depths, live hosts) and the workers' job
  counters (failed jobs by failure code, automatic retries by task and reason), read from
  Redis by a custom collector at scrape time, so they are right whichever process answers
  and cost a couple of Redis round trips per scrape. Workers count into Redis hashes
  (poolcore/state/counters.py, jobs.py) as they record a job's failure or retry.

Labels stay bounded: requests are labelled by the Flask endpoint name (``pool.allocate``,
``runs.create_run``, ...), never by the raw path; a request that matched no route is
``unmatched``; and by tenant: a name of the tenants file, or ``-`` (app/tenancy.py `label`).

Each request is also added to the pool dashboard's record of the last hour in Redis
(poolcore/state/recent.py), which /metrics's cumulative series cannot give: counted in the
process and written once a second (app/recent_requests.py), off the request's path.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from flask import Flask, Response, current_app, g, request, request_started
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, multiprocess
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app import tenancy
from app.recent_requests import RecentRequests
from poolcore.config import QUEUE_KINDS, Settings
from poolcore.queues import MAINTENANCE_QUEUE, queue_name
from poolcore.state import UNAVAILABLE, Store

log = logging.getLogger(__name__)

# From a millisecond allocate to a reset that builds an image or an evaluation of minutes.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
UNMATCHED = "unmatched"
SKIPPED_ENDPOINTS = {"metrics"}  # scrapes would only measure themselves
# Not in the dashboard's record of the last hour: the pages and their polls, the probes.
UNRECORDED_PREFIXES = ("viewer.", "pool_view.", "pool.healthz", "pool.readyz", UNMATCHED)
SCRAPE_REDIS_TIMEOUT = 2.0


def multiprocess_dir() -> str | None:
    """The multiprocess directory when prometheus_client runs in multiprocess mode."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112 (the older name, still read)
    return path if path and os.path.isdir(path) else None


# ---- request metrics ----------------------------------------------------------------------
@dataclass
class RequestMetrics:
    latency: Histogram
    requests: Counter
    errors: Counter

    def metrics(self):
        return (self.latency, self.requests, self.errors)


_REQUEST_METRICS: RequestMetrics | None = None


def request_metrics() -> RequestMetrics:
    """The process's request metrics, made once (a second set would fight over the same
    multiprocess files); registered in no global registry, each app collects them itself."""
    global _REQUEST_METRICS
    if _REQUEST_METRICS is None:
        _REQUEST_METRICS = RequestMetrics(
            latency=Histogram(
                "termpool_http_request_duration_seconds",
                "Time to answer a request, by Flask endpoint (the pool or runs API operation) and tenant.",
                ["endpoint", "method", "tenant"],
                buckets=LATENCY_BUCKETS,
                registry=None,
            ),
            requests=Counter(
                "termpool_http_requests",
                "Requests answered, by Flask endpoint, exact status code and tenant.",
                ["endpoint", "method", "status", "tenant"],
                registry=None,
            ),
            errors=Counter(
                "termpool_http_errors",
                "Error replies (status >= 400) by endpoint, status class and the reply's "
                "`code` field (none when it has none), and tenant.",
                ["endpoint", "status_class", "code", "tenant"],
                registry=None,
            ),
        )
    return _REQUEST_METRICS


class _InProcess(Collector):
    """Single-process mode: hand out the in-memory request metrics."""

    def __init__(self, metrics: RequestMetrics):
        self._metrics = metrics

    def collect(self):
        for metric in self._metrics.metrics():
            yield from metric.collect()


def _error_code(response: Response) -> str:
    """The `code` field of a JSON error reply, or "none"; only small JSON bodies are read."""
    if not response.is_json or response.is_streamed:
        return "none"
    length = response.content_length
    if length is not None and length > 64 * 1024:
        return "none"
    body = response.get_json(silent=True)
    code = body.get("code") if isinstance(body, dict) else None
    if isinstance(code, str) and code and len(code) <= 64:
        return code
    return "none"


def _start_timer(sender: Flask, **_) -> None:
    g._termpool_started = time.perf_counter()


def _instrument(app: Flask, metrics: RequestMetrics) -> None:
    # Flask sends request_started before any before_request hook runs, whatever the order they
    # were registered in: requests the guard refuses are timed too.
    request_started.connect(_start_timer, app)

    @app.after_request
    def record(response: Response):
        endpoint = request.endpoint or UNMATCHED
        if endpoint in SKIPPED_ENDPOINTS:
            return response
        started = g.get("_termpool_started")
        seconds = time.perf_counter() - started if started is not None else None
        try:
            tenant, status = tenancy.label(), response.status_code
            code = _error_code(response) if status >= 400 else ""
            method = request.method if request.method in _METHODS else "other"
            if seconds is not None:
                metrics.latency.labels(endpoint, method, tenant).observe(seconds)
            metrics.requests.labels(endpoint, method, str(status), tenant).inc()
            if code:
                metrics.errors.labels(endpoint, f"{status // 100}xx", code, tenant).inc()
            if seconds is not None and not endpoint.startswith(UNRECORDED_PREFIXES):
                app.extensions["termpool_metrics"]["recent"].add(tenant, endpoint, seconds, code)
        except Exception:  # metrics must never break a reply
            log.exception("recording request metrics failed")
        return response


_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}


# ---- pool gauges from Redis ---------------------------------------------------------------
class PoolCollector(Collector):
    """Gauges read from the state store at scrape time (a few Redis round trips)."""

    def __init__(self, cfg: Settings):
        self.cfg = cfg
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            # A store of its own with short timeouts: a stuck Redis must not stall the scrape.
            self._store = Store.connect(self.cfg, timeout=SCRAPE_REDIS_TIMEOUT, wait_out=False)
        return self._store

    def describe(self):
        return []  # never collect at registration time

    def collect(self):
        up = GaugeMetricFamily("termpool_redis_up", "1 when this scrape could read the state store from Redis.")
        try:
            families = self._read()
        except UNAVAILABLE as exc:
            log.warning("metrics: cannot read pool state from Redis: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self) -> list:
        store = self.store
        live = store.live_hosts()
        hosts = sorted(set(live) | {self.cfg.host_id})
        status = {host: store.host_status(host) for host in hosts}
        queues = {(host, kind): queue_name(host, kind) for host in hosts for kind in QUEUE_KINDS}
        waiting = store.queue_depths([*queues.values(), MAINTENANCE_QUEUE])

        runs = GaugeMetricFamily(
            "termpool_live_runs",
            "Live runs (leases holding a capacity slot), by worker host and task key.",
            labels=["host", "task_key"],
        )
        tasks = GaugeMetricFamily(
            "termpool_active_tasks", "Distinct task keys with live runs, by worker host.", labels=["host"]
        )
        total = GaugeMetricFamily(
            "termpool_live_runs_total", "Live runs on a worker host, all task keys.", labels=["host"]
        )
        closes = GaugeMetricFamily(
            "termpool_pending_closes", "Runs released whose teardown has not finished, by worker host.", labels=["host"]
        )
        depth = GaugeMetricFamily(
            "termpool_queue_depth",
            "Messages waiting in a Celery queue (LLEN of its Redis lists).",
            labels=["queue", "host", "kind"],
        )
        for host in hosts:
            for task_key, value in status[host]["tasks"].items():
                runs.add_metric([host, task_key], value["active_runs"])
            tasks.add_metric([host], status[host]["active_tasks"])
            total.add_metric([host], status[host]["total_active_runs"])
            closes.add_metric([host], status[host]["pending_closes"])
            for kind in QUEUE_KINDS:
                queue = queues[host, kind]
                depth.add_metric([queue, host, kind], waiting[queue])
        depth.add_metric([MAINTENANCE_QUEUE, "", "maintenance"], waiting[MAINTENANCE_QUEUE])

        hosts_up = GaugeMetricFamily("termpool_live_hosts", "Worker hosts whose heartbeat is recent.")
        hosts_up.add_metric([], len(live))
        limits = GaugeMetricFamily(
            "termpool_capacity_limit", "Capacity settings of the pool, per worker host.", labels=["limit"]
        )
        limits.add_metric(["max_tasks"], self.cfg.max_tasks)
        limits.add_metric(["max_runs_per_task"], self.cfg.max_runs_per_task)
        return [runs, tasks, total, closes, depth, hosts_up, limits, *self._job_counters(store)]

    @staticmethod
    def _job_counters(store: Store) -> list:
        failed = CounterMetricFamily(
            "termpool_job_failures",
            "Jobs that failed, by failure code (see the failure "
            "taxonomy; steps skipped after a failed one are not counted).",
            labels=["code"],
        )
        for code, n in sorted(store.failure_counts().items()):
            failed.add_metric([code], n)
        retries = CounterMetricFamily(
            "termpool_job_retries",
            "Automatic retries of a Celery task after a transient failure, by task and reason (failure code).",
            labels=["task", "reason"],
        )
        for (task, reason), n in sorted(store.retry_counts().items()):
            retries.add_metric([task, reason], n)
        return [failed, retries]


# ---- the endpoint -------------------------------------------------------------------------
def _registry(app: Flask) -> CollectorRegistry:
    """What one scrape collects: every process's request metrics plus the pool gauges."""
    state = app.extensions["termpool_metrics"]
    path = multiprocess_dir()
    if path is None:
        return state["registry"]
    registry = CollectorRegistry(auto_describe=False)
    multiprocess.MultiProcessCollector(registry, path=path)
    registry.register(state["pool"])
    return registry


def metrics_view():
    registry = _registry(current_app)
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return Response(encoder(registry), status=200, headers={"Content-Type": content_type})


def init_metrics(app: Flask) -> None:
    """Register the /metrics endpoint and request instrumentation."""
    cfg = app.extensions["termpool"].cfg
    disable_created_metrics()  # *_created series: noise here, and absent in multiprocess mode anyway
    metrics = request_metrics()
    pool = PoolCollector(cfg)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_InProcess(metrics))
    registry.register(pool)
    recent = RecentRequests(lambda: pool.store)
    app.extensions["termpool_metrics"] = {
        "registry": registry,
        "pool": pool,
        "request_metrics": metrics,
        "recent": recent,
    }
    _instrument(app, metrics)
    app.add_url_rule("/metrics", endpoint="metrics", view_func=metrics_view, methods=["GET"])
