"""Prometheus metrics of the facade, served at /metrics."""
from __future__ import annotations

from flask import Flask


def init_metrics(app: Flask) -> None:
    """Register the /metrics endpoint and request instrumentation."""
