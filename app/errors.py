"""JSON errors for every failure: bad input 400, unknown routes 404, backends away 503.

Every refusal is ``{"ok": false, "error": ..., "code": ..., "retryable": ...}`` with a code of
termpool/failures.py; HTTP errors raised by Werkzeug keep their headers (a 405's ``Allow``).
"""

from __future__ import annotations

import logging

import kombu.exceptions
import redis.exceptions
from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app.validation import MAX_BODY_BYTES, BadRequest
from termpool.codes import HTTP_STATUS_CODES
from termpool.failures import retryable

log = logging.getLogger(__name__)

BACKEND_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, kombu.exceptions.OperationalError)

# Werkzeug's HTTP errors by status (HTTP_STATUS_CODES); any other 4xx is a bad request, any
# other 5xx internal.


def error_reply(status: int, error: str, code: str, headers=None):
    """The JSON body, status (and headers) of a refusal; retryable as failures.py says."""
    body = jsonify({"ok": False, "error": error, "code": code, "retryable": retryable(code)})
    return (body, status, headers) if headers else (body, status)


def http_code(status: int) -> str:
    return HTTP_STATUS_CODES.get(status) or ("INTERNAL" if status >= 500 else "BAD_REQUEST")


def register(app: Flask) -> None:
    @app.errorhandler(BadRequest)
    def bad_request(exc):
        return error_reply(400, str(exc), "BAD_REQUEST")

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        status = exc.code or 500
        headers = [(k, v) for k, v in exc.get_headers() if k.lower() != "content-type"]
        return error_reply(status, exc.description or exc.name, http_code(status), headers)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc):
        return error_reply(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "PAYLOAD_TOO_LARGE")

    def backend_down(exc):
        log.warning("backend unreachable: %s", exc)
        return error_reply(503, f"Redis is unreachable: {exc}", "BACKEND_UNAVAILABLE")

    for exc_class in BACKEND_DOWN:
        app.register_error_handler(exc_class, backend_down)

    @app.errorhandler(Exception)
    def unexpected(exc):
        log.exception("unhandled error")
        return error_reply(500, f"{type(exc).__name__}: {exc}", "INTERNAL")
