"""The pool dashboard at /ui/pool (docs/dashboard.md): hosts, tenants' use against their quotas,
queue depths, builds under way, and the last hour's failures and latencies as charts.

The page is a shell; app/static/pool.js fetches /ui/pool/data every POLL_SECONDS and draws it
(tables, and charts with the vendored Chart.js, app/static/vendor/chartjs). Sign-in is the run
viewer's (app/viewer.py): a bearer token or its cookie. The operator sees the whole pool; a
tenant sees its own slice: the hosts' states with its own runs on each, its own row of quota,
and only its own requests' latencies and failures. Queue depths and builds are the pool's and
are not shown to a tenant.

The last hour comes from poolcore/state/recent.py (written as the facade answers and as jobs
fail); the rest is read when asked, as /status reads it.
"""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, render_template

from app import tenancy, viewer
from poolcore.config import QUEUE_KINDS
from poolcore.queues import queue_name

bp = Blueprint("pool_view", __name__, url_prefix="/ui/pool", template_folder="templates")
bp.after_request(viewer.page_headers)

POLL_SECONDS = 3


def _engine():
    return current_app.extensions["termpool"]


@bp.get("")
def page():
    tenant = tenancy.current()
    scope = tenant.name if tenant else ""
    return render_template("pool/dashboard.html", poll=POLL_SECONDS, scope=scope, kinds=QUEUE_KINDS)


@bp.get("/data")
def data():
    tenant = tenancy.current()
    return jsonify(_tenant_slice(tenant) if tenant else _whole_pool())


def _whole_pool() -> dict:
    engine = _engine()
    status = engine.status()
    hosts = sorted(status["hosts"])
    depths = engine.store.queue_depths([queue_name(host, kind) for host in hosts for kind in QUEUE_KINDS])
    return {
        "scope": "",
        "hosts": [_host_row(host, status["hosts"][host]) for host in hosts],
        "tenants": _tenant_rows(list(engine.cfg.tenants.by_name.values())),
        "queues": [{"host": host, **{kind: depths[queue_name(host, kind)] for kind in QUEUE_KINDS}} for host in hosts],
        "builds": engine.store.builds_in_progress(),
        **engine.store.recent_activity(),
    }


def _host_row(host: str, status: dict) -> dict:
    capacity = status.get("capacity") or {}
    return {
        "host": host,
        "state": status.get("state", "not reporting"),
        "live_runs": status["total_active_runs"],
        "capacity": capacity.get("max_tasks", 0) * capacity.get("max_runs_per_task", 0),
        "networks": status.get("networks"),
        "disk": status.get("disk"),
        "live_restore": status.get("live_restore"),
    }


def _tenant_rows(tenants: list) -> list[dict]:
    live = _engine().store.tenant_live_counts([t.name for t in tenants])
    return [
        {
            "name": t.name,
            "live_runs": live[t.name],
            "max_runs": t.max_runs,
            "reserved_runs": t.reserved_runs,
            "priority": t.priority,
        }
        for t in tenants
    ]


def _tenant_slice(tenant) -> dict:
    """What a tenant sees: each host's state and its own runs there, its own quota row, and
    its own requests and failed jobs of the last hour."""
    engine = _engine()
    own = tenancy.tenant_status(engine, tenant)["hosts"]
    overview = engine.host_overview()
    return {
        "scope": tenant.name,
        "hosts": [
            {
                "host": host,
                "state": overview.get(host, {}).get("state", "not reporting"),
                "live_runs": own.get(host, {}).get("total_active_runs", 0),
            }
            for host in sorted(set(overview) | set(own))
        ],
        "tenants": _tenant_rows([tenant]),
        "queues": [],
        "builds": [],
        **engine.store.recent_activity(tenant.name),
    }
