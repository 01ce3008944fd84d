"""Tenants on the HTTP faces (docs/tenants.md): whom a request's token names, and the one check
that hides every other tenant's runs and jobs.

The check runs before any route (app/__init__.py `_guard`), on the id the request names: a run
id in the path, a job id in the path (the job's run decides), or the pool API's `lease_id`. A
run of another tenant (or the operator's) is answered exactly as an unknown one is on that
route, so nothing tells a tenant it exists; the route itself never sees the request. The
operator's token (POOL_API_TOKEN) sees everything; without a tenants file everyone is the
operator, as before tenants.
"""

from __future__ import annotations

import hmac

from flask import abort, g, request

from termpool.config import Settings
from termpool.tenants import Tenant

OPERATOR = None  # g.tenant of the operator (admin): every run is its own
NOBODY = object()  # a token that names no one


def identify(cfg: Settings, header: str):
    """The tenant a request's Authorization header names: a Tenant, OPERATOR, or NOBODY."""
    if not cfg.tenants:  # one tenant: today's single token, or none at all
        if not cfg.api_token or header == f"Bearer {cfg.api_token}":
            return OPERATOR
        return NOBODY
    scheme, _, token = header.partition(" ")
    if scheme != "Bearer" or not token:
        return NOBODY
    if cfg.api_token and hmac.compare_digest(token.encode(), cfg.api_token.encode()):
        return OPERATOR
    return cfg.tenants.for_token(token) or NOBODY


def current() -> Tenant | None:
    """The request's tenant; None for the operator."""
    return g.get("tenant")


def name() -> str:
    tenant = current()
    return tenant.name if tenant else ""


def sees(run: dict | None) -> bool:
    """Whether the request's tenant may see this run record (a list's row, a /status count)."""
    tenant = current()
    return tenant is None or (run or {}).get("tenant") == tenant.name


def hide_foreign(store):
    """Before a route: the answer an unknown run or job gets there, when the request names one
    of another tenant's; None to let the route run (its own, unknown ones, or the operator)."""
    tenant = current()
    if tenant is None:
        return None
    run_id, job_id = _named_ids()
    if job_id:
        run_id = store.job_run(job_id)
    if not run_id:
        return None
    owner = store.run_owner(run_id)
    if owner is None or owner == tenant.name:  # no such run: the route answers that itself
        return None
    return _unknown_answer(run_id, job_id)


def _named_ids() -> tuple[str, str]:
    args = request.view_args or {}
    if "job_id" in args:
        return "", args["job_id"]
    if "run_id" in args:
        return args["run_id"], ""
    if request.blueprint == "pool" and request.method == "POST":
        body = request.get_json(silent=True)  # cached: the route reads the same parse
        lease = body.get("lease_id") if isinstance(body, dict) else None
        return (lease if isinstance(lease, str) else ""), ""
    return "", ""


def _unknown_answer(run_id: str, job_id: str):
    """What each route answers for an id it does not know (byte for byte: tests/test_tenants.py)."""
    from app import runs_api, viewer
    from app.engine import UnknownLease
    from app.http import ok
    from app.models import CloseReply

    if request.blueprint == "viewer":
        if request.endpoint == "viewer.run":
            return viewer.not_found(run_id)
        abort(404)
    if job_id:
        return runs_api.fail("UNKNOWN_JOB", f"unknown job: {job_id}")
    if request.endpoint == "pool.close":
        return ok(CloseReply(found=False))
    raise UnknownLease(run_id)  # each face's handler: 500 UNKNOWN_LEASE, 404 UNKNOWN_RUN


def tenant_status(engine, tenant: Tenant) -> dict:
    """/status as a tenant sees it: the pool's limits, and live runs counted over its own runs
    only (per task key and per host), with its quota; other tenants' runs are not its to see."""
    runs = engine.store.runs_fields(engine.store.tenant_live_runs(tenant.name), ("task_key", "host"))
    tasks: dict = {}
    hosts: dict = {}
    for run in runs.values():
        key, host = run.get("task_key", ""), run.get("host", "")
        tasks.setdefault(key, {"active_runs": 0})["active_runs"] += 1
        on_host = hosts.setdefault(host, {"total_active_runs": 0, "tasks": {}})
        on_host["total_active_runs"] += 1
        on_host["tasks"].setdefault(key, {"active_runs": 0})["active_runs"] += 1
    return {
        "max_tasks": engine.cfg.max_tasks,
        "active_tasks": len(tasks),
        "max_runs_per_task": engine.cfg.max_runs_per_task,
        "total_active_runs": len(runs),
        "pending_closes": 0,  # teardowns are the pool's, not counted per tenant
        "tasks": tasks,
        "hosts": hosts,
        "tenant": {
            "name": tenant.name,
            "live_runs": len(runs),
            "max_runs": tenant.max_runs,
            "reserved_runs": tenant.reserved_runs,
            "priority": tenant.priority,
        },
    }
