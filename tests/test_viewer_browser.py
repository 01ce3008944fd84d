"""The run viewer in a real headless browser (Debian's Chromium driven by Playwright): open
/ui/, find a live run, click into it, watch its transcript grow and its tests appear without
reloading, and take a screenshot.

Chromium comes from apt (scripts/setup.sh), Playwright from PyPI (requirements-dev.txt; its
wheel ships the driver, no `playwright install`). TERMPOOL_SKIP_BROWSER=1 skips this module;
TERMPOOL_UPDATE_SCREENSHOT=1 also writes the screenshot to docs/images/viewer.png.
"""

from __future__ import annotations

import os
import re

from devstack import ROOT
from poolcore.state import Store
from tests.browser import skip_without_browser
from tests.conftest import run_containers

skip_without_browser()

from playwright.sync_api import expect  # noqa: E402

SCREENSHOT = ROOT / "docs" / "images" / "viewer.png"
SLOW = 300_000  # ms: a run's steps on a loaded machine


def _live_episode(stack) -> str:
    """A solved hello-file episode through the runs API, slow enough to be watched live:
    its second call waits for a file the test creates once the page shows the first."""
    script = [
        {
            "name": "shell_exec",
            "arguments": {
                "id": "main",
                "block": True,
                "timeout": 60,
                "command": "echo 'Hello, world!' > /app/hello.txt && ls -l /app",
            },
        },
        {
            "name": "shell_exec",
            "arguments": {
                "id": "main",
                "block": True,
                "timeout": 240,
                "command": "until [ -e /tmp/go ]; do sleep 0.2; done; cat /app/hello.txt",
            },
        },
    ]
    reply = stack.post(
        "/v1/runs", {"task_meta": {"task_name": "hello-file"}, "script": script, "evaluate": True, "close": True}
    )
    assert reply.status_code == 202, reply.text
    return reply.json()["run_id"]


def test_watch_a_live_run(stack, browser, docker_client, tmp_path):
    run_id = _live_episode(stack)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(stack.url + "/ui/?task=hello-file")
    row = page.locator("table.runs tr", has=page.locator(f"a:text-is('{run_id}')"))
    expect(row).to_contain_text("hello-file")
    expect(row).to_contain_text(stack.host_id)

    row.get_by_role("link", name=run_id).click()
    expect(page).to_have_url(re.compile(rf"/ui/runs/{run_id}$"))
    expect(page.locator("h1")).to_have_text(run_id)
    first_call = page.locator("article.tool_call").first
    expect(first_call).to_contain_text("echo 'Hello, world!' > /app/hello.txt", timeout=SLOW)
    expect(first_call.locator("pre.observation")).to_contain_text("hello.txt", timeout=SLOW)
    second_call = page.locator("article.tool_call").nth(1)
    expect(second_call.locator(".badge")).to_have_text("running", timeout=SLOW)
    expect(page.locator("#run-state")).not_to_have_text("closed")

    # Let the waiting call finish; the open page picks up the rest by itself (no reload).
    page.evaluate("window.__same_document = true")
    _release_second_call(docker_client, stack, run_id)
    expect(second_call.locator("pre.observation")).to_contain_text("Hello, world!", timeout=SLOW)
    expect(page.locator("#tests")).to_contain_text(re.compile(r"[1-9]\d* passed, 0 failed"), timeout=SLOW)
    expect(page.locator("#run-state")).to_have_text("closed", timeout=SLOW)
    expect(page.locator("#run-score")).to_have_text("1.0")
    assert page.evaluate("window.__same_document") is True, "the page was reloaded, not updated in place"
    expect(page.locator("#artifacts a", has_text="tests.log")).to_be_visible()
    assert not dialogs

    page.evaluate("window.scrollTo(0, 0)")
    shot = page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)
    assert len(shot) < 300_000
    if os.environ.get("TERMPOOL_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(shot)
    page.close()


def test_hostile_output_is_shown_as_text(stack, browser):
    """Markup in a command and its observation is text on the page: no element, no script."""
    hostile = "<img src=x onerror=alert(1)><script>alert(2)</script><b>bold</b>"
    reply = stack.post(
        "/v1/runs",
        {
            "task_meta": {"task_name": "hello-file"},
            "close": True,
            "script": [
                {
                    "name": "shell_exec",
                    "arguments": {"id": "main", "block": True, "timeout": 60, "command": f"printf '%s\\n' '{hostile}'"},
                }
            ],
        },
    )
    assert reply.status_code == 202, reply.text
    run_id = reply.json()["run_id"]
    page = browser.new_page()
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(f"{stack.url}/ui/runs/{run_id}")
    expect(page.locator("#run-state")).to_have_text("closed", timeout=SLOW)
    expect(page.locator("pre.observation")).to_have_text(hostile + "\n")
    assert page.locator("main img, main script, article.tool_call b:not(.tool)").count() == 0
    assert not dialogs
    page.close()


def _release_second_call(docker_client, stack, run_id: str) -> None:
    """Create /tmp/go in the run's container from outside, so the transcript holds only the episode."""
    containers = run_containers(docker_client, Store(stack.redis), run_id)
    assert containers, "the run's container is not running"
    assert containers[0].exec_run(["touch", "/tmp/go"]).exit_code == 0
