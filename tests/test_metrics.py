"""/metrics: request histograms summed over both gunicorn workers, errors by kind, pool gauges
read from Redis, and the bearer-token guard."""

from __future__ import annotations

import uuid

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_app

SCRAPES = 6  # fresh connections, so both gunicorn worker processes answer some of them


def scrape(stack) -> dict:
    """One scrape on a new connection: {(sample name, sorted labels): value}."""
    reply = requests.get(stack.url + "/metrics", timeout=30, headers={"Connection": "close"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def allocate_count(samples):
    return value(samples, "termpool_http_request_duration_seconds_count", endpoint="pool.allocate", method="POST")


def errors(samples, code):
    return value(samples, "termpool_http_errors_total", endpoint="pool.allocate", status_class="4xx", code=code)


def test_metrics_follow_pool_calls(stack):
    before = scrape(stack)
    key = f"metrics-{uuid.uuid4().hex[:8]}"
    max_runs = 8  # the stack's WORKER_MAX_RUNS_PER_TASK (the default)
    leases = []
    for _ in range(max_runs):
        reply = stack.post(
            "/allocate", {"task_key": key, "request_id": uuid.uuid4().hex}, headers={"Connection": "close"}
        )
        assert reply.status_code == 200, reply.text
        leases.append(reply.json()["lease_id"])
    full = stack.post("/allocate", {"task_key": key, "request_id": uuid.uuid4().hex})
    assert full.status_code == 429 and full.json()["code"] == "RUN_SLOTS_EXHAUSTED", full.text
    assert stack.post("/allocate", {}).status_code == 400
    unknown = f"run-{uuid.uuid4().hex[:16]}"
    assert stack.get(f"/v1/runs/{unknown}").status_code == 404  # runs API: labelled by route, not path

    try:
        for _ in range(SCRAPES):
            after = scrape(stack)
            # Every worker process answers with the same, summed, totals.
            assert allocate_count(after) - allocate_count(before) == max_runs + 2
            ok = ("termpool_http_requests_total", dict(endpoint="pool.allocate", method="POST", status="200"))
            assert value(after, ok[0], **ok[1]) - value(before, ok[0], **ok[1]) == max_runs
            inf = dict(endpoint="pool.allocate", method="POST", le="+Inf")
            assert value(after, "termpool_http_request_duration_seconds_bucket", **inf) == allocate_count(after)
            assert errors(after, "BAD_REQUEST") - errors(before, "BAD_REQUEST") == 1
            assert errors(after, "RUN_SLOTS_EXHAUSTED") - errors(before, "RUN_SLOTS_EXHAUSTED") == 1
            unknown_run = dict(endpoint="runs.get_run", status_class="4xx", code="UNKNOWN_RUN")
            assert (
                value(after, "termpool_http_errors_total", **unknown_run)
                - value(before, "termpool_http_errors_total", **unknown_run)
                == 1
            )
            # Gauges from Redis.
            assert value(after, "termpool_redis_up") == 1
            assert value(after, "termpool_live_runs", host=stack.host_id, task_key=key) == max_runs
            assert value(after, "termpool_live_hosts") >= 1
            for kind in ("build", "lifecycle", "exec", "eval", "teardown"):
                assert (
                    "termpool_queue_depth",
                    (("host", stack.host_id), ("kind", kind), ("queue", f"termpool.{stack.host_id}.{kind}")),
                ) in after
            # No raw paths as label values: run ids never appear.
            assert not any(run_id in str(labels) for _, labels in after for run_id in leases + [unknown])
    finally:
        for lease in leases:
            assert stack.post("/close", {"lease_id": lease}).json()["found"] is True

    closed = scrape(stack)
    assert value(closed, "termpool_live_runs", host=stack.host_id, task_key=key) == 0
    close_count = value(closed, "termpool_http_request_duration_seconds_count", endpoint="pool.close", method="POST")
    assert (
        close_count
        - value(before, "termpool_http_request_duration_seconds_count", endpoint="pool.close", method="POST")
        == max_runs
    )


def test_metrics_behind_the_token_and_without_redis():
    """In one process (no multiprocess folder): the guard applies to /metrics, and a scrape
    with Redis away still answers, with termpool_redis_up 0."""
    client = make_app(
        {
            "POOL_API_TOKEN": "s3cret",
            "REDIS_URL": "redis://127.0.0.1:1/0",
            "POOL_HOST_ID": "metrics-test",
            "DATASET_DIR": "/tmp",
            "TBENCH_OUTPUT_ROOT": "/tmp",
        }
    ).test_client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/status").status_code == 401
    reply = client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
    assert reply.status_code == 200
    text = reply.get_data(as_text=True)
    assert "termpool_redis_up 0.0" in text
    # Refused requests are counted under their endpoint; scrapes are not counted at all.
    assert 'termpool_http_requests_total{endpoint="pool.status",method="GET",status="401"}' in text
    # ... and timed: the timer starts before the guard's before_request hook refuses them.
    assert 'termpool_http_request_duration_seconds_count{endpoint="pool.status",method="GET"}' in text
    assert 'endpoint="metrics"' not in text
