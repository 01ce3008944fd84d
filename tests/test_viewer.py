"""The run viewer at /ui/ over HTTP, against the real stack: an episode through the pool API
shows up in the list and on its page (transcript, tests, artifacts), filters, escaping of
hostile observations, the token gate for browsers, and the recent-runs index in Redis."""

from __future__ import annotations

import html
import os
import re
import time

import markupsafe
import pytest
import requests

from devstack import Stack
from poolcore import dispatch
from poolcore import state as state_module
from poolcore.state import Store
from tests.conftest import wait_for
from tests.test_capacity import allocate

HOSTILE = "<script>alert('pwned')</script>"


@pytest.fixture(scope="module")
def episode(stack, router, docker_client):
    """A solved hello-file episode through the pool API, with a hostile observation; closed."""
    lease = router.allocate("hello-file")
    reply = router.reset(lease, "hello-file")
    assert reply.status_code == 200, reply.text
    router.solve(lease, "hello-file")
    assert HOSTILE in router.sh(lease, f'echo "{HOSTILE}"')
    assert router.evaluate(lease).json()["score"] == 1.0
    live_page = stack.get(f"/ui/runs/{lease}").text
    router.close(lease)
    assert wait_for(lambda: Store(stack.redis).get_run(lease)["state"] == "closed", 90)
    return {"run_id": lease, "live_page": live_page}


def _text(page: str) -> str:
    """The page's text with tags dropped and entities decoded, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_list_shows_the_run(stack, episode):
    reply = stack.get("/ui/")
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/html")
    row = re.search(
        rf'<tr class="state-closed">\s*<td><a href="/ui/runs/{episode["run_id"]}">.*?</tr>', reply.text, re.S
    )
    assert row, "the closed run is not listed"
    cells = _text(row.group(0))
    assert "hello-file" in cells and stack.host_id in cells and "closed" in cells and "1.0" in cells
    assert re.search(r"\d+(\.\d+)? (s|min)", cells), cells  # created -> closed and the start job's duration


def test_list_filters_by_state_and_task(stack, episode):
    run_id = episode["run_id"]
    assert run_id in stack.get("/ui/", params={"state": "closed"}).text
    assert run_id in stack.get("/ui/", params={"task": "hello-file"}).text
    assert run_id in stack.get("/ui/", params={"state": "closed", "task": "hello-file"}).text
    assert run_id not in stack.get("/ui/", params={"state": "ready"}).text
    assert run_id not in stack.get("/ui/", params={"task": "partial-pass"}).text
    for odd in ({"state": "no-such-state"}, {"limit": "x"}, {"limit": "-5"}, {"before": "nan"}, {"before": "inf"}):
        assert stack.get("/ui/", params=odd).status_code == 200, odd
    older = stack.get("/ui/", params={"limit": 1}).text
    cursor = re.search(r'href="(/ui/\?[^"]*before=[^"]+)"', older)
    assert cursor, "no link to older runs"
    assert stack.get(html.unescape(cursor.group(1))).status_code == 200


def test_run_page_has_transcript_tests_and_artifacts(stack, episode):
    run_id = episode["run_id"]
    reply = stack.get(f"/ui/runs/{run_id}")
    assert reply.status_code == 200
    page, text = reply.text, _text(reply.text)
    # The transcript: each call's name and arguments (from Redis), its observation, its time.
    assert text.count("shell_write_content_to_file") == 1 and "/tmp/solution.sh" in text
    assert "bash /tmp/solution.sh" in text and "shell_exec" in text
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC · ran \d", text)
    assert re.search(r'id="run-state">closed<', page) and re.search(r'id="run-score">1.0<', page)
    # The tests, with pass/fail.
    assert re.search(r"\d+ passed, 0 failed", text)
    assert re.search(r'class="badge passed">passed</span></td><td><code>[^<]*test', page)
    # Artifacts: served from TBENCH_OUTPUT_ROOT (the stack's facade is on the workers' host).
    link = re.search(rf'href="(/ui/runs/{run_id}/files/tool_calls.jsonl)"', page)
    assert link and f'/ui/runs/{run_id}/files/tests.log"' in page
    log = stack.get(link.group(1))
    assert log.status_code == 200 and log.headers["Content-Type"].startswith("text/plain")
    assert "sandbox" in log.headers["Content-Security-Policy"]
    assert "shell_exec" in log.text
    # Closed: the page no longer polls.
    assert "data-refresh" not in page and 'data-refresh="2"' in episode["live_page"]


def test_observations_are_escaped(stack, episode):
    page = stack.get(f"/ui/runs/{episode['run_id']}").text
    assert HOSTILE not in page and "<script>alert" not in page
    assert page.count(str(markupsafe.escape(HOSTILE))) == 2  # in the command and in the observation
    assert page.count("<script") == 1 and 'src="/ui/static/viewer.js"' in page
    assert "script-src 'self'" in stack.get(f"/ui/runs/{episode['run_id']}").headers["Content-Security-Policy"]


def test_files_stay_inside_the_run_folder(stack, episode):
    run_id = episode["run_id"]
    folder = Store(stack.redis).get_run(run_id)["env"]["run_dir"]
    os.symlink("/etc/passwd", os.path.join(folder, "escape"))
    assert "/files/escape" not in stack.get(f"/ui/runs/{run_id}").text
    for name in (
        "escape",
        "%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "..%2f..%2f..%2fetc%2fpasswd",
        "sessions",
        "no-such-file",
    ):
        reply = requests.get(f"{stack.url}/ui/runs/{run_id}/files/{name}", timeout=30)
        assert reply.status_code == 404 and "root:" not in reply.text, name


def test_unknown_run_is_a_404_page(stack):
    reply = stack.get("/ui/runs/run-0000000000000000")
    assert reply.status_code == 404 and reply.headers["Content-Type"].startswith("text/html")
    assert "Unknown run" in reply.text and "run-0000000000000000" in reply.text
    assert stack.get("/ui/runs/run-0000000000000000/files/tests.log").status_code == 404


def test_runs_api_episode_records_its_calls(stack):
    """A one-shot episode's tool calls are in its job records from the start, capped in size."""
    big = "x" * (dispatch.CALL_FIELD_LIMIT * 3)
    reply = stack.post(
        "/v1/runs",
        {
            "task_meta": {"task_name": "hello-file"},
            "close": True,
            "script": [{"name": "shell_write_content_to_file", "arguments": {"file_path": "/tmp/big", "content": big}}],
        },
    )
    assert reply.status_code == 202, reply.text
    call_job = reply.json()["jobs"]["tool_calls"][0]
    record = Store.from_url(f"redis://127.0.0.1:{stack.redis_port}/0").get_job(call_job)
    assert record["call"]["name"] == "shell_write_content_to_file"
    assert len(record["call"]["arguments"]["content"]) == dispatch.CALL_FIELD_LIMIT
    assert record["call"]["arguments"]["file_path"] == "/tmp/big"
    assert wait_for(lambda: stack.get(f"/v1/runs/{reply.json()['run_id']}").json()["run"]["state"] == "closed", 120)


# ---- the token gate --------------------------------------------------------------------------
TOKEN = "viewer-s3cret"


@pytest.fixture(scope="module")
def guarded(base_image):
    s = Stack(env={"POOL_API_TOKEN": TOKEN}).start()
    yield s
    s.stop()


def test_token_gate(guarded):
    ui = guarded.url + "/ui/"
    refused = requests.get(ui, timeout=30)
    assert refused.status_code == 401 and 'type="password"' in refused.text  # the login form
    assert requests.get(ui, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).status_code == 200
    assert requests.get(guarded.url + "/ui/static/viewer.css", timeout=30).status_code == 200
    wrong = requests.post(
        guarded.url + "/ui/login", data={"token": "nope", "next": "/ui/"}, timeout=30, allow_redirects=False
    )
    assert wrong.status_code == 401 and "not the pool's token" in wrong.text and "set-cookie" not in wrong.headers

    browser = requests.Session()
    login = browser.post(
        guarded.url + "/ui/login", data={"token": TOKEN, "next": "/ui/?state=closed"}, timeout=30, allow_redirects=False
    )
    assert login.status_code == 303 and login.headers["Location"] == "/ui/?state=closed"
    cookie = login.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/ui" in cookie and TOKEN not in cookie
    assert browser.get(ui, timeout=30).status_code == 200
    assert browser.get(guarded.url + "/ui/runs/run-0000000000000000", timeout=30).status_code == 404
    # The cookie reads the viewer only: not the API, and no other method.
    assert browser.get(guarded.url + "/status", timeout=30).status_code == 401
    assert browser.post(guarded.url + "/allocate", json={"task_key": "hello-file"}, timeout=30).status_code == 401
    assert browser.get(guarded.url + "/v1/runs/run-0", timeout=30).status_code == 401
    # A forged cookie does not pass; the login never redirects off the viewer.
    forged = requests.get(ui, cookies={"termpool_viewer": "0" * 64}, timeout=30)
    assert forged.status_code == 401
    away = requests.post(
        guarded.url + "/ui/login", data={"token": TOKEN, "next": "//evil.example/"}, timeout=30, allow_redirects=False
    )
    assert away.status_code == 303 and away.headers["Location"] == "/ui/"


# ---- the recent-runs index and the recorded call (Redis alone) -------------------------------
@pytest.mark.unit
def test_recent_runs_index(redis_server):
    redis_server.flushdb()
    store = Store(redis_server)
    store.recent_runs_kept = 5
    ids = []
    for i in range(7):
        ids.append(allocate(store, f"task-{i % 2}", "", "h", max_tasks=100, max_runs=100).run_id)
        time.sleep(0.002)
    assert redis_server.zcard(state_module.RECENT_RUNS) == 5  # trimmed to the newest
    assert 0 < redis_server.ttl(state_module.RECENT_RUNS) <= state_module.RECORD_TTL
    runs, cursor = store.recent_runs(("task_key",), 3)
    assert [r["run_id"] for r in runs] == ids[:1:-1][:3] and cursor is not None
    rest, end = store.recent_runs(("task_key",), 3, cursor)
    assert [r["run_id"] for r in rest] == ids[3:1:-1] and end is None
    assert runs[0]["task_key"] == "task-0" and runs[0]["state"] == "allocated"
    redis_server.delete(state_module.run_key(ids[-1]))  # an expired record leaves the index when next read
    assert ids[-1] not in [r["run_id"] for r in store.recent_runs(("task_key",), 10)[0]]
    assert redis_server.zscore(state_module.RECENT_RUNS, ids[-1]) is None
    first = allocate(store, "task-0", "req", "h", max_tasks=100, max_runs=100)
    assert allocate(store, "task-0", "req", "h", max_tasks=100, max_runs=100).reused  # a repeat adds no entry
    assert [r["run_id"] for r in store.recent_runs((), 10)[0]] == [first.run_id, *ids[5:1:-1]]


@pytest.mark.unit
def test_recorded_call_caps_each_field():
    call = {
        "name": "shell_exec",
        "arguments": {"id": "a", "command": "c" * 10_000, "block": True, "timeout": 20, "extra": {"k": ["v" * 10_000]}},
    }
    kept = dispatch.recorded_call(call)
    assert kept["name"] == "shell_exec" and kept["arguments"]["id"] == "a"
    assert kept["arguments"]["block"] is True and kept["arguments"]["timeout"] == 20
    command = kept["arguments"]["command"]
    assert len(command) == dispatch.CALL_FIELD_LIMIT and "characters cut" in command
    assert isinstance(kept["arguments"]["extra"], str) and len(kept["arguments"]["extra"]) == dispatch.CALL_FIELD_LIMIT
    small = {"name": "shell_view", "arguments": {"id": "a", "extra": {"k": 1}}}
    assert dispatch.recorded_call(small) == small
