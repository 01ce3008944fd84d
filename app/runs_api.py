"""The runs API (POOL_API.md section 2): submit and poll by run id and job id."""
from __future__ import annotations

from flask import Blueprint

bp = Blueprint("runs", __name__, url_prefix="/v1")
