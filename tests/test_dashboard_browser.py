"""The pool dashboard (/ui/pool, docs/dashboard.md) in a real headless browser (Debian's Chromium
driven by Playwright, as tests/test_viewer_browser.py): a live pool of two hosts (the second on a
second dockerd, tests/second_docker.py) with runs of two tenants. The operator's page shows both
hosts and both tenants' use, draws its charts from the last hour's requests, and shows a new run
without a reload; a tenant's sign-in shows its own row and runs only. /metrics labels the same
requests by tenant.

TERMPOOL_SKIP_BROWSER=1 skips this module; TERMPOOL_UPDATE_SCREENSHOT=1 also writes the
operator's page to docs/images/dashboard.png.
"""

from __future__ import annotations

import os

import pytest
import requests

from devstack import ROOT
from poolcore.config import QUEUE_KINDS
from tests.browser import skip_without_browser
from tests.second_docker import second_docker, two_host_stack  # noqa: F401 (the fixture)
from tests.test_metrics import parse, value

skip_without_browser()

from playwright.sync_api import expect  # noqa: E402

ADMIN, A, B = "admin-token-0000", "team-a-token-1111", "team-b-token-2222"
TENANTS = f"""\
tenants:
  team-a: {{token: {A}, max_runs: 6, reserved_runs: 2, priority: eval}}
  team-b: {{token: {B}, max_runs: 8}}
"""
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"
SLOW = 120_000  # ms: a poll on a loaded machine


@pytest.fixture(scope="module")
def pool(second_docker, docker_client, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    env = {"POOL_API_TOKEN": ADMIN, "TENANTS_FILE": str(path), "WORKER_MAX_TASKS": "4", "WORKER_MAX_RUNS_PER_TASK": "4"}
    yield from two_host_stack(second_docker, docker_client, env)


def call(stack, token: str, path: str, body: dict | None = None) -> requests.Response:
    method = "POST" if body is not None else "GET"
    return requests.request(
        method, stack.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=600
    )


def lease(stack, token: str, key: str) -> str:
    reply = call(stack, token, "/allocate", {"task_key": key})
    assert reply.status_code == 200, reply.text
    return reply.json()["lease_id"]


def reset(stack, token: str, run_id: str) -> None:
    meta = {"task_name": "hello-file", "task_path": "hello-file", "instruction": "write the file"}
    reply = call(stack, token, "/reset", {"lease_id": run_id, "task_meta": meta})
    assert reply.status_code == 200 and reply.json()["ok"], reply.text


@pytest.fixture(scope="module")
def runs(pool):
    """Runs of both tenants: each has one started (a container on some host) and one leased."""
    made = {"team-a": [], "team-b": []}
    try:
        for name, token in (("team-a", A), ("team-b", B)):
            made[name] += [lease(pool, token, "hello-file"), lease(pool, token, f"dash-{name}")]
            reset(pool, token, made[name][0])
        assert call(pool, A, "/heartbeat", {"lease_id": "run-0000000000000000"}).status_code == 500  # an error code
        yield made
    finally:
        for run_id in made["team-a"] + made["team-b"]:
            assert call(pool, ADMIN, "/close", {"lease_id": run_id}).status_code == 200


def sign_in(browser, stack, token: str):
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    page.goto(stack.url + "/ui/pool")
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_contain_text("Pool")
    return page


def runs_cell(page, table: str, key: str):
    return page.locator(f"#{table} tr[data-key='{key}'] td.runs")


def test_the_operator_sees_the_whole_pool_live(pool, runs, browser, tmp_path):
    page = sign_in(browser, pool, ADMIN)
    for host in (pool.host_id, pool.host_b):
        row = page.locator(f"#hosts tr[data-key='{host}']")
        expect(row).to_contain_text("serving", timeout=SLOW)
        expect(row.locator("td.runs")).to_contain_text(" / 16")  # runs used of 4 x 4
    expect(runs_cell(page, "tenants", "team-a")).to_have_text("2", timeout=SLOW)
    expect(runs_cell(page, "tenants", "team-b")).to_have_text("2")
    for host in (pool.host_id, pool.host_b):  # each host's queue of each kind
        expect(page.locator(f"#queues tr[data-key='{host}'] td.num")).to_have_count(len(QUEUE_KINDS))

    # The charts are drawn from the last hour's record: both tenants' allocates and resets.
    page.wait_for_function(
        "() => { const c = window.termpoolPool.charts['latency-chart'];"
        " return c && ['pool.allocate', 'pool.reset'].every(op => c.data.labels.includes(op)); }",
        timeout=SLOW,
    )
    latency = page.evaluate("window.termpoolPool.charts['latency-chart'].data.datasets.map(d => d.data)")
    assert all(v > 0 for series in latency for v in series), latency
    # Each gunicorn worker writes its counts once a second (app/recent_requests.py): the error
    # reply may have been answered by the other one.
    page.wait_for_function(
        "() => window.termpoolPool.charts['failures-chart'].data.labels.includes('UNKNOWN_LEASE')", timeout=SLOW
    )
    assert page.locator("canvas#latency-chart").bounding_box()["height"] > 100

    # A new run appears without a reload.
    page.evaluate("window.__same_document = true")
    polls = page.evaluate("window.termpoolPool.polls")
    runs["team-b"].append(lease(pool, B, "dash-new"))
    expect(runs_cell(page, "tenants", "team-b")).to_have_text("3", timeout=SLOW)
    assert page.evaluate("window.__same_document") is True, "the page was reloaded, not updated in place"
    assert page.evaluate("window.termpoolPool.polls") > polls

    shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert len(shot) < 300_000
    if os.environ.get("TERMPOOL_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.write_bytes(shot)
    page.close()


def test_a_tenant_sees_its_own_slice(pool, runs, browser):
    page = sign_in(browser, pool, A)
    expect(page.locator("h1")).to_contain_text("as team-a")
    expect(runs_cell(page, "tenants", "team-a")).to_have_text(str(len(runs["team-a"])), timeout=SLOW)
    expect(page.locator("#tenants tbody tr")).to_have_count(1)
    expect(page.locator("#hosts tr[data-key]")).to_have_count(2)
    shown = [int(text) for text in page.locator("#hosts td.runs").all_text_contents()]
    assert sum(shown) == len(runs["team-a"])  # its own runs on each host, no one else's
    assert page.locator("#queues, #builds").count() == 0
    page.wait_for_function("() => window.termpoolPool.polls > 0", timeout=SLOW)
    assert "team-b" not in page.content()
    page.close()

    data = call(pool, A, "/ui/pool/data").json()
    assert [t["name"] for t in data["tenants"]] == ["team-a"] and data["queues"] == data["builds"] == []
    assert data["latency"]["pool.allocate"]["requests"] == 2  # its own two, not team-b's
    assert data["errors"] == {"UNKNOWN_LEASE": 1}


def test_metrics_label_the_tenants(pool, runs):
    reply = call(pool, ADMIN, "/metrics")
    assert reply.status_code == 200
    samples = parse(reply.text)
    count = "termpool_http_request_duration_seconds_count"
    assert value(samples, count, endpoint="pool.allocate", method="POST", tenant="team-a") == 2
    assert value(samples, count, endpoint="pool.allocate", method="POST", tenant="team-b") == len(runs["team-b"])
    assert value(samples, count, endpoint="pool.reset", method="POST", tenant="team-b") == 1
    assert value(samples, count, endpoint="pool.allocate", method="POST", tenant="-") == 0  # the operator made none
