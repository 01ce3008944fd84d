"""JSON errors for every failure: bad input 400, unknown routes 404, backends away 503."""
from __future__ import annotations

import logging

import kombu.exceptions
import redis.exceptions
from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

from app.validation import BadRequest

log = logging.getLogger(__name__)

BACKEND_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, kombu.exceptions.OperationalError)


def _reply(status: int, error: str, **fields):
    return jsonify({"ok": False, "error": error, **fields}), status


def register(app: Flask) -> None:
    @app.errorhandler(BadRequest)
    def bad_request(exc):
        return _reply(400, str(exc))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        return _reply(exc.code or 500, exc.description or exc.name)

    def backend_down(exc):
        log.warning("backend unreachable: %s", exc)
        return _reply(503, f"Redis is unreachable: {exc}", code="BACKEND_UNAVAILABLE")

    for exc_class in BACKEND_DOWN:
        app.register_error_handler(exc_class, backend_down)

    @app.errorhandler(Exception)
    def unexpected(exc):
        log.exception("unhandled error")
        return _reply(500, f"{type(exc).__name__}: {exc}")
