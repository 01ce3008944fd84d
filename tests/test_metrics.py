"""/metrics: request histograms summed over both gunicorn workers, errors by kind, pool gauges
read from Redis, and the bearer-token guard."""

from __future__ import annotations

import uuid

import requests
from prometheus_client.parser import text_string_to_metric_families

from poolcore.state import Store
from tests.conftest import make_app, wait_for

OPERATOR = "-"  # the tenant label of the operator's requests (and every request without a tenants file)
SCRAPES = 6  # fresh connections, so both gunicorn worker processes answer some of them


def scrape(stack) -> dict:
    """One scrape on a new connection: {(sample name, sorted labels): value}."""
    reply = requests.get(stack.url + "/metrics", timeout=30, headers={"Connection": "close"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["Content-Type"].startswith("text/plain")
    return parse(reply.text)


def parse(text: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def allocate_count(samples):
    return value(
        samples,
        "termpool_http_request_duration_seconds_count",
        endpoint="pool.allocate",
        method="POST",
        tenant=OPERATOR,
    )


def errors(samples, code):
    return value(
        samples, "termpool_http_errors_total", endpoint="pool.allocate", status_class="4xx", code=code, tenant=OPERATOR
    )


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
            ok = (
                "termpool_http_requests_total",
                dict(endpoint="pool.allocate", method="POST", status="200", tenant=OPERATOR),
            )
            assert value(after, ok[0], **ok[1]) - value(before, ok[0], **ok[1]) == max_runs
            inf = dict(endpoint="pool.allocate", method="POST", le="+Inf", tenant=OPERATOR)
            assert value(after, "termpool_http_request_duration_seconds_bucket", **inf) == allocate_count(after)
            assert errors(after, "BAD_REQUEST") - errors(before, "BAD_REQUEST") == 1
            assert errors(after, "RUN_SLOTS_EXHAUSTED") - errors(before, "RUN_SLOTS_EXHAUSTED") == 1
            unknown_run = dict(endpoint="runs.get_run", status_class="4xx", code="UNKNOWN_RUN", tenant=OPERATOR)
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
    close_count = value(
        closed, "termpool_http_request_duration_seconds_count", endpoint="pool.close", method="POST", tenant=OPERATOR
    )
    assert (
        close_count
        - value(
            before,
            "termpool_http_request_duration_seconds_count",
            endpoint="pool.close",
            method="POST",
            tenant=OPERATOR,
        )
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
    assert 'termpool_http_requests_total{endpoint="pool.status",method="GET",status="401",tenant="-"}' in text
    # ... and timed: the timer starts before the guard's before_request hook refuses them.
    assert 'termpool_http_request_duration_seconds_count{endpoint="pool.status",method="GET",tenant="-"}' in text
    assert 'endpoint="metrics"' not in text


TENANTS = """\
tenants:
  team-a: {token: team-a-token-1111, max_runs: 4}
  team-b: {token: team-b-token-2222}
"""


def test_tenant_label_and_the_last_hour(redis_server, tmp_path):
    """In one process, on a bare redis-server: a tenant's requests carry its name as the tenant
    label, the operator's `-`; each request also lands in the dashboard's record of the last
    hour (poolcore/state/recent.py), which a tenant reads only its own of."""
    redis_server.flushdb()
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    port = redis_server.connection_pool.connection_kwargs["port"]
    app = make_app(
        {
            "POOL_API_TOKEN": "admin-0000",
            "TENANTS_FILE": str(tenants),
            "REDIS_URL": f"redis://127.0.0.1:{port}/0",
            "POOL_HOST_ID": "metrics-tenants",
            "DATASET_DIR": "/tmp",
            "TBENCH_OUTPUT_ROOT": "/tmp",
        }
    )
    client = app.test_client()
    before = in_process_scrape(client)  # the request metrics are the process's: other tests' too
    for token, n in (("team-a-token-1111", 3), ("team-b-token-2222", 1), ("admin-0000", 2)):
        for _ in range(n):
            assert client.get("/status", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert (
        client.get("/v1/runs/run-0000000000000000", headers={"Authorization": "Bearer team-a-token-1111"}).status_code
        == 404
    )
    assert client.get("/status", headers={"Authorization": "Bearer wrong"}).status_code == 401

    after = in_process_scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    count = "termpool_http_request_duration_seconds_count"
    assert delta(count, endpoint="pool.status", method="GET", tenant="team-a") == 3
    assert delta(count, endpoint="pool.status", method="GET", tenant="team-b") == 1
    assert delta(count, endpoint="pool.status", method="GET", tenant=OPERATOR) == 3  # the refused one too
    unknown = dict(endpoint="runs.get_run", status_class="4xx", code="UNKNOWN_RUN", tenant="team-a")
    assert delta("termpool_http_errors_total", **unknown) == 1
    tenants_seen = {dict(labels).get("tenant") for _, labels in after} - {None}
    assert tenants_seen == {"team-a", "team-b", OPERATOR}  # bounded: the file's names and `-`

    store = Store.from_url(f"redis://127.0.0.1:{port}/0")
    # Written once a second, off the requests' path (app/recent_requests.py).
    assert wait_for(lambda: store.recent_activity()["latency"].get("pool.status", {}).get("requests") == 7, 5)
    everyone, team_a = store.recent_activity(), store.recent_activity("team-a")
    assert everyone["latency"]["pool.status"]["requests"] == 7
    assert team_a["latency"]["pool.status"]["requests"] == 3
    assert team_a["errors"] == {"UNKNOWN_RUN": 1}
    assert everyone["errors"] == {"UNKNOWN_RUN": 1, "UNAUTHORIZED": 1}
    assert 0 < team_a["latency"]["pool.status"]["p50_ms"] <= team_a["latency"]["pool.status"]["p95_ms"]
    assert "metrics" not in everyone["latency"]


def in_process_scrape(client) -> dict:
    return parse(client.get("/metrics", headers={"Authorization": "Bearer admin-0000"}).get_data(as_text=True))
