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
import threading
import uuid

from flask import current_app, g, request

from app.engine import Refused
from poolcore import priorities
from poolcore.config import Settings
from poolcore.state import NO_TENANT, new_run_id
from poolcore.tenants import Tenant

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


def label() -> str:
    """The request's tenant as a metrics label and in the dashboard's record: its name, or
    NO_TENANT for the operator, a guest and a refused request (bounded: names come from the file)."""
    tenant = g.get("tenant")
    return tenant.name if isinstance(tenant, Tenant) and tenant is not GUEST else NO_TENANT


def run_priority(asked: str | None) -> str:
    """The class of a run the request makes (poolcore/priorities.py resolve): its tenant's unless
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
    owner = OWNERS.get((job, named))
    if owner is None:
        run_id = store.job_run(named) if job else named
        owner = store.run_owner(run_id) if run_id else None
        if owner is not None:
            OWNERS.put((job, named), owner)
    return owner is not None and owner != tenant.name


class Owners:
    """Whose each run (and each job's run) is, as read once in this process: a run's tenant is
    set when it is made and never changes, and its id is never given to another run, so a
    remembered owner stays true (a run whose record has gone answers as unknown either way).
    Saves the owner's Redis round trip on every later call on a lease. Bounded: the oldest
    entries go first."""

    def __init__(self, size: int):
        self.size = size
        self._known: dict = {}
        self._lock = threading.Lock()

    def get(self, key) -> str | None:
        return self._known.get(key)

    def put(self, key, owner: str) -> None:
        with self._lock:
            self._known[key] = owner
            while len(self._known) > self.size:
                del self._known[next(iter(self._known))]

    def made(self, run_id: str, tenant: Tenant | None) -> None:
        """A run just made for this tenant (None: the operator)."""
        self.put((False, run_id), tenant.name if tenant else "")


OWNERS = Owners(size=20_000)  # a few MB at most per gunicorn worker


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
            "quotas": quota_use(engine.store, tenant, len(runs)),
        },
    }


def quota_use(store, tenant: Tenant, live_runs: int) -> dict:
    """Its use against each quota (docs/tenants.md, "Quotas"); a limit of None is none."""
    return {
        "runs": {"used": live_runs, "max": tenant.max_runs},
        "builds": {"used": store.builds_in_flight(tenant.name), "max": tenant.max_builds},
        "upload_bytes": {"used": store.upload_bytes(tenant.name), "max": tenant.max_upload_bytes},
    }
