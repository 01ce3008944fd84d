"""Tenants on the HTTP faces (docs/tenants.md): whom a request's token names, and the one check
that hides every other tenant's runs and jobs.

The check runs on the id a request names, before its route looks at it: a run id in the path,
a job id in the path (the job's run decides), or a body's `lease_id` (the pool API). Another
tenant's id (or one of the operator's runs) is swapped for a fresh id that names nothing, and
swapped back in the answer: the route answers exactly what it answers an unknown id, after
the same validation, so nothing tells a tenant the run exists and no route has a check of its
own to forget. The operator's token (POOL_API_TOKEN) sees everything; without a tenants file
everyone is the operator, as before tenants.
"""

from __future__ import annotations

import hmac
import uuid

from flask import current_app, g, request

from app.engine import Refused
from termpool import priorities
from termpool.config import Settings
from termpool.state import new_run_id
from termpool.tenants import Tenant

OPERATOR = None  # g.tenant of the operator (admin): every run is its own
NOBODY = object()  # a token that names no one
GUEST = Tenant(name=" guest", token="")  # the viewer's sign-in page: no name a run can have


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


def run_priority(asked: str | None) -> str:
    """The class of a run the request makes (termpool/priorities.py resolve): its tenant's unless
    it asks for a lower one; Refused PRIORITY_NOT_ALLOWED above it, before anything is taken."""
    tenant = current()
    try:
        return priorities.resolve(asked, tenant.priority if tenant else None)
    except priorities.PriorityNotAllowed as exc:
        raise Refused("PRIORITY_NOT_ALLOWED", str(exc)) from None


def sees(run: dict | None) -> bool:
    """Whether the request's tenant may see this run record (a list's row, a /status count)."""
    tenant = current()
    return tenant is None or (run or {}).get("tenant") == tenant.name


def disguise_path(store) -> None:
    """Before a route: a run or job id in the path that is another tenant's becomes an id that
    names nothing (see `unmask`)."""
    args = request.view_args or {}
    for name in ("run_id", "job_id"):
        if isinstance(args.get(name), str) and _foreign(store, args[name], job=name == "job_id"):
            args[name] = _stand_in(args[name], job=name == "job_id")


def disguise_body(body: dict) -> dict:
    """The pool API's `lease_id` in a request body, likewise (app/http.py json_body)."""
    lease = body.get("lease_id")
    if current() is not None and isinstance(lease, str) and _foreign(_store(), lease, job=False):
        return {**body, "lease_id": _stand_in(lease, job=False)}
    return body


def unmask(reply):
    """After a route: the stand-in id in its answer becomes the id the request named, so the
    answer is, byte for byte, the route's answer to an unknown id."""
    swapped = g.get("stand_ins")
    if swapped and not reply.is_streamed and reply.mimetype in ("application/json", "text/html"):
        data = reply.get_data()
        for stand_in, real in swapped.items():
            data = data.replace(stand_in.encode(), real.encode())
        reply.set_data(data)
    return reply


def _foreign(store, named: str, job: bool) -> bool:
    """Whether the id names a run (or a job of a run) of someone else than the request's tenant."""
    tenant = current()
    if tenant is None or not named:
        return False
    run_id = store.job_run(named) if job else named
    owner = store.run_owner(run_id) if run_id else None
    return owner is not None and owner != tenant.name


def _stand_in(real: str, job: bool) -> str:
    stand_in = str(uuid.uuid4()) if job else new_run_id()  # the shape of a real one, naming nothing
    g.setdefault("stand_ins", {})[stand_in] = real
    return stand_in


def _store():
    return current_app.extensions["termpool"].store


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
