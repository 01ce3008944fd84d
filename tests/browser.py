"""What the browser tests share: Debian's Chromium driven by Playwright (its wheel ships the
driver, no `playwright install`): how it is started (the `browser` fixture in tests/conftest.py)
and when to skip a module of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def skip_without_browser() -> None:
    """Skip the calling test module when asked to (TERMPOOL_SKIP_BROWSER=1) or without Chromium."""
    if os.environ.get("TERMPOOL_SKIP_BROWSER") == "1":
        pytest.skip("TERMPOOL_SKIP_BROWSER=1", allow_module_level=True)
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/setup.sh)", allow_module_level=True)
