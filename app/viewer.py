"""The run viewer at /ui/: recent runs and one run's episode, server-rendered, read-only.

Everything it shows comes from Redis (the facade may run on another host than the run's
containers and files): the run record, and each job record, which holds a tool call's name
and arguments (capped, poolcore/dispatch.py `recorded_call`) and its observation. A run's files
are served only when the facade sees the run's folder under its own TBENCH_OUTPUT_ROOT;
otherwise the page names the host and path.

Access: the same client allow-list and POOL_API_TOKEN as the API (app/__init__.py `_guard`).
A browser cannot send a bearer header, so with a token set /ui/login takes it once in a
POST form (never in a URL, which gunicorn's access log would keep) and sets an HttpOnly,
SameSite=Lax cookie holding an HMAC of the token, not the token. That cookie admits GET and
HEAD requests under /ui/ only: it can read the viewer, never call the API. Changing the
token invalidates every cookie.

Pages are Jinja templates (autoescaped: observations are hostile text), served with a
Content-Security-Policy that allows only this blueprint's own script and style sheet.
Viewing a run does not mark it as used (it is not a call on its lease).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from flask import Blueprint, abort, current_app, redirect, render_template, request, send_file, url_for

from app import tenancy
from poolcore import failures
from poolcore.paths import PathError, resolve_inside
from poolcore.state import RECENT_RUNS_KEPT

bp = Blueprint("viewer", __name__, url_prefix="/ui", template_folder="templates", static_folder="static")

COOKIE = "termpool_viewer"
STATES = ("allocated", "starting", "ready", "busy", "evaluating", "evaluated", "failed", "closing", "closed")
LIST_FIELDS = ("task_key", "host", "created_at", "closed_at", "score", "code", "error", "tenant")
START_JOB_FIELDS = ("state", "queued_at", "finished_at")
DEFAULT_LIMIT, MAX_LIMIT = 50, 500
SCAN_PAGE = 200  # index entries read per round trip while filtering the list
OBSERVATION_SHOWN = 32 * 1024  # characters of one observation on the page (head and tail)
MAX_FILES = 500  # files listed per run
REFRESH_SECONDS = {"list": 5, "run": 2}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


def _engine():
    return current_app.extensions["termpool"]


# ---- access -----------------------------------------------------------------------------------
def _cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"termpool run viewer", hashlib.sha256).hexdigest()


def browser_gate(cfg):
    """For `_guard`, on a /ui/ request without a bearer token: (who, None) to let it through
    (the login page and static files as a guest; a GET with a good cookie as the one whose
    token made it: the operator, or a tenant, app/tenancy.py), else (NOBODY, the login page)."""
    if request.endpoint in ("viewer.login", "viewer.static"):
        return tenancy.GUEST, None
    cookie = request.cookies.get(COOKIE, "")
    if request.method in ("GET", "HEAD"):
        for token in _tokens(cfg):
            if hmac.compare_digest(cookie, _cookie_value(token)):
                return tenancy.identify(cfg, f"Bearer {token}"), None
    return tenancy.NOBODY, (render_template("viewer/login.html", next=request.full_path.rstrip("?"), wrong=False), 401)


def _tokens(cfg) -> list[str]:
    """The tokens a browser may sign in with: the operator's, and each tenant's."""
    return [token for token in (cfg.api_token, *(t.token for t in cfg.tenants.by_name.values())) if token]


def _safe_next(target: str) -> str:
    """Only a path of this viewer, so the login form cannot redirect anywhere else."""
    if target.startswith("/ui/") and not target.startswith("//") and "\\" not in target:
        return target
    return url_for("viewer.runs")


@bp.route("/login", methods=["GET", "POST"])
def login():
    cfg = _engine().cfg
    target = _safe_next(request.values.get("next", ""))
    if not _tokens(cfg):
        return redirect(target, 303)
    if request.method == "GET":
        return render_template("viewer/login.html", next=target, wrong=False)
    token = request.form.get("token", "")
    if not any(hmac.compare_digest(token.encode(), known.encode()) for known in _tokens(cfg)):
        return render_template("viewer/login.html", next=target, wrong=True), 401
    reply = redirect(target, 303)
    reply.set_cookie(
        COOKIE,
        _cookie_value(token),
        httponly=True,
        samesite="Lax",
        secure=request.is_secure,
        path=url_for("viewer.runs"),
    )
    return reply


@bp.after_request
def page_headers(reply):
    """The pages' security headers (this blueprint's and the pool dashboard's, app/pool_view.py)."""
    reply.headers.setdefault("Content-Security-Policy", CSP)  # a served file has its own, stricter one
    reply.headers["X-Content-Type-Options"] = "nosniff"
    reply.headers["Referrer-Policy"] = "same-origin"
    if request.endpoint != "viewer.static":
        reply.headers["Cache-Control"] = "no-store"
    return reply


# ---- formatting -------------------------------------------------------------------------------
@bp.app_template_filter("utc")
def _utc(ts) -> str:
    if not isinstance(ts, (int, float)):
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


@bp.app_template_filter("duration")
def _duration(seconds) -> str:
    if not isinstance(seconds, (int, float)):
        return ""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs} s" if minutes < 120 else f"{minutes // 60} h {minutes % 60} min"


def _span(start, end):
    """end - start when both are times, else None."""
    if isinstance(start, (int, float)) and isinstance(end, (int, float)):
        return max(end - start, 0.0)
    return None


# ---- the list of recent runs ------------------------------------------------------------------
def _limit() -> int:
    try:
        return min(max(int(request.args.get("limit", DEFAULT_LIMIT)), 1), MAX_LIMIT)
    except ValueError:
        return DEFAULT_LIMIT


def _before() -> float | None:
    try:
        before = float(request.args["before"])
    except (KeyError, ValueError):
        return None
    return before if math.isfinite(before) else None


def _matching_runs(state: str, task: str, before: float | None, limit: int) -> tuple[list[dict], float | None]:
    """Newest indexed runs matching the filters, and the cursor for the next page (None at the
    end). Filtering happens here, over at most RECENT_RUNS_KEPT index entries."""
    store, runs, cursor, scanned = _engine().store, [], before, 0
    while scanned < RECENT_RUNS_KEPT:
        page, next_cursor = store.recent_runs(LIST_FIELDS, SCAN_PAGE, cursor)
        scanned += SCAN_PAGE
        for run in page:
            if not tenancy.sees(run):  # a tenant's list holds its own runs (app/tenancy.py)
                continue
            if (not state or run["state"] == state) and (not task or run.get("task_key") == task):
                runs.append(run)
                if len(runs) == limit:
                    return runs, run.get("created_at")
        if next_cursor is None:
            return runs, None
        cursor = next_cursor
    return runs, cursor


def _list_row(run: dict, start_job: dict | None, now: float) -> dict:
    closed = run.get("closed_at")
    started = start_job if start_job and start_job.get("kind") == "start" else None
    return {
        **run,
        "lifetime": _span(run.get("created_at"), closed if closed else now),
        "live": run["state"] != "closed",
        "start_state": started.get("state") if started else None,
        "start_seconds": _span(started.get("queued_at"), started.get("finished_at")) if started else None,
    }


@bp.get("/")
def runs():
    state = request.args.get("state", "")
    state = state if state in STATES else ""
    task = request.args.get("task", "").strip()
    found, cursor = _matching_runs(state, task, _before(), _limit())
    starts = _engine().store.first_jobs([run["run_id"] for run in found], START_JOB_FIELDS)
    now = time.time()
    rows = [_list_row(run, starts.get(run["run_id"]), now) for run in found]
    older = (
        url_for(
            "viewer.runs", state=state or None, task=task or None, limit=request.args.get("limit"), before=repr(cursor)
        )
        if cursor is not None
        else None
    )
    first_page = "before" not in request.args  # it polls for new runs and state changes
    return render_template(
        "viewer/runs.html",
        rows=rows,
        states=STATES,
        state=state,
        task=task,
        older=older,
        refresh=REFRESH_SECONDS["list"] if first_page else 0,
    )


# ---- one run ----------------------------------------------------------------------------------
def _entries(jobs: list[dict]) -> list[dict]:
    """The jobs as transcript entries: when each began and ran, how long it waited in its
    queue, and a tool call's observation cut for the page. A step of a one-shot episode is
    recorded up front, so its wait counts from the end of the step before it."""
    entries, previous_end = [], None
    for job in jobs:
        ready = max(t for t in (job.get("queued_at"), previous_end, 0.0) if isinstance(t, (int, float)))
        entry = {
            **job,
            "at": job.get("started_at") or job.get("queued_at"),
            "seconds": _span(job.get("started_at"), job.get("finished_at")),
            "waited": _span(ready, job.get("started_at")),
        }
        if job.get("kind") == "tool_call" and isinstance(job.get("result"), str):
            entry["observation"] = failures.cap(job["result"], OBSERVATION_SHOWN)
        if job.get("kind") == "command" and isinstance(job.get("result"), dict):
            entry["streams"] = {
                name: failures.cap(str(job["result"].get(name) or ""), OBSERVATION_SHOWN)
                for name in ("stdout", "stderr")
            }
        entries.append(entry)
        previous_end = job.get("finished_at") or previous_end
    return entries


def _tests(run: dict, jobs: list[dict]) -> dict:
    """The run's test results, else those of its newest finished evaluation."""
    if isinstance(run.get("tests"), dict):
        return run["tests"]
    for job in reversed(jobs):
        result = job.get("result")
        if job.get("kind") == "evaluation" and isinstance(result, dict) and isinstance(result.get("tests"), dict):
            return result["tests"]
    return {}


def _run_folder(run: dict) -> Path | None:
    """The run's folder when this host sees it inside TBENCH_OUTPUT_ROOT, else None."""
    run_dir = (run.get("env") or {}).get("run_dir")
    if not run_dir:
        return None
    try:
        folder = resolve_inside(_engine().cfg.output_root, run_dir, allow_absolute=True, allow_root=False)
    except PathError:
        return None
    return folder if folder.is_dir() else None


def _files(folder: Path) -> list[dict]:
    """The run folder's files (following its links, which must stay in the output root)."""
    root = _engine().cfg.output_root
    listed = []
    for parent, dirs, names in os.walk(folder, followlinks=True):
        dirs.sort()
        if not _inside(root, Path(parent)):
            dirs.clear()
            continue
        for name in sorted(names):
            path = Path(parent) / name
            if len(listed) < MAX_FILES and path.is_file() and _inside(root, path):
                listed.append({"name": path.relative_to(folder).as_posix(), "size": path.stat().st_size})
    return listed


def _inside(root: Path, path: Path) -> bool:
    try:
        resolve_inside(root, str(path), allow_absolute=True)
    except PathError:
        return False
    return True


def _listed_file(folder: Path, name: str) -> Path | None:
    """A file the listing would show: a plain relative path below the folder (no ``..``)
    that, links followed, is a regular file inside the output root. (A warm-pool run's
    log folders are links to another run folder there.)"""
    relative = PurePosixPath(name)
    if "\x00" in name or relative.is_absolute() or ".." in relative.parts or not relative.parts:
        return None
    path = folder.joinpath(*relative.parts)
    return path if path.is_file() and _inside(_engine().cfg.output_root, path) else None


def _not_found(run_id: str):
    return render_template("viewer/not_found.html", run_id=run_id), 404


@bp.get("/runs/<run_id>")
def run(run_id: str):
    store = _engine().store
    record = store.shown_run(run_id)
    if record is None:
        return _not_found(run_id)
    jobs = store.get_jobs(store.run_jobs(run_id))
    folder = _run_folder(record)
    tests = _tests(record, jobs)
    return render_template(
        "viewer/run.html",
        run=record,
        entries=_entries(jobs),
        tests=tests,
        failed_tests=sum(1 for outcome in tests.values() if outcome != "passed"),
        lifetime=_span(record.get("created_at"), record.get("closed_at") or time.time()),
        run_dir=(record.get("env") or {}).get("run_dir"),
        files=_files(folder) if folder else None,
        refresh=REFRESH_SECONDS["run"] if record["state"] != "closed" else 0,
    )


@bp.get("/runs/<run_id>/files/<path:name>")
def run_file(run_id: str, name: str):
    """One file of the run's folder, always as plain text (never rendered by the browser)."""
    record = _engine().store.get_run(run_id)
    folder = _run_folder(record) if record else None
    if folder is None:
        abort(404)
    path = _listed_file(folder, name)
    if path is None:
        abort(404)
    reply = send_file(path, mimetype="text/plain", max_age=0, conditional=True)
    reply.headers["Content-Security-Policy"] = "sandbox; default-src 'none'"
    return reply
