"""schemathesis hooks of the fuzz run: a check that no reply is an unexpected error."""

from __future__ import annotations

import schemathesis


@schemathesis.check
def no_internal_error(ctx, response, case):
    """A declared 500 (unknown lease, run not reset) is fine; an unhandled exception is not."""
    if response.status_code >= 500:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("code") == "INTERNAL":
            raise AssertionError(f"unexpected server error {response.status_code}: {response.text[:300]}")
    return None
