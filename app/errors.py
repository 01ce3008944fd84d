"""JSON errors for every failure: bad input 400, unknown routes 404, backends away 503.

Every refusal is ``{"ok": false, "error": ..., "code": ..., "retryable": ...}`` with a code of
poolcore/failures.py; HTTP errors raised by Werkzeug keep their headers (a 405's ``Allow``).
"""

from __future__ import annotations

import logging

import kombu.exceptions
import redis.exceptions
from flask import Flask, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app.fields import MAX_BODY_BYTES
from app.http import BadRequest, fail
from termpool.codes import HTTP_STATUS_CODES

log = logging.getLogger(__name__)

BACKEND_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, kombu.exceptions.OperationalError)

# Werkzeug's HTTP errors by status (HTTP_STATUS_CODES); any other 4xx is a bad request, any
# other 5xx internal.


def http_code(status: int) -> str:
    return HTTP_STATUS_CODES.get(status) or ("INTERNAL" if status >= 500 else "BAD_REQUEST")


def refused_for_memory(exc: BaseException | None) -> bool:
    """Whether Redis's OOM refusal is behind `exc` (raised itself, or the cause of a wrapper)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, redis.exceptions.OutOfMemoryError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def register(app: Flask) -> None:
    @app.errorhandler(BadRequest)
    def bad_request(exc):
        return fail("BAD_REQUEST", str(exc), 400)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        status = exc.code or 500
        headers = [(k, v) for k, v in exc.get_headers() if k.lower() != "content-type"]
        return fail(http_code(status), exc.description or exc.name, status, headers)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc):  # the route's own limit where it set one (an archive upload's)
        limit = request.max_content_length or MAX_BODY_BYTES
        return fail("PAYLOAD_TOO_LARGE", f"the request body is larger than {limit} bytes", 413)

    def backend_down(exc):
        if refused_for_memory(exc):  # kombu wraps a refused publish in its OperationalError
            return backend_full(exc)
        log.warning("backend unreachable: %s", exc)
        return fail("REDIS_UNAVAILABLE", f"Redis is unreachable: {exc}", 503)

    for exc_class in BACKEND_DOWN:
        app.register_error_handler(exc_class, backend_down)

    @app.errorhandler(redis.exceptions.OutOfMemoryError)
    def backend_full(exc):
        log.warning("Redis refused a write: %s", exc)
        return fail("BACKEND_FULL", f"Redis is at its memory limit and refused a write: {exc}", 503)

    @app.errorhandler(Exception)
    def unexpected(exc):
        log.exception("unhandled error")
        return fail("INTERNAL", f"{type(exc).__name__}: {exc}", 500)
