"""The HTTP facade: validates requests, records and enqueues jobs, answers. Never touches Docker."""

from __future__ import annotations

import ipaddress
import logging

import redis
from celery import Celery
from flask import Flask, g, request

from app import errors, pool_view, tenancy, viewer
from app.engine import Engine
from app.fields import MAX_BODY_BYTES
from app.http import fail
from poolcore.config import Settings, settings
from poolcore.queues import follow_monitor
from poolcore.state import Store

log = logging.getLogger(__name__)


def celery_init_app(app: Flask, cfg: Settings) -> Celery:
    """The Flask docs' pattern: one Celery app, kept in app.extensions."""
    from poolcore.queues import make_celery

    celery = make_celery(cfg)
    celery.set_default()
    app.extensions["celery"] = celery
    return celery


PROBES = ("/healthz", "/readyz")  # what an orchestrator asks, without a token
BROWSER_PAGES = ("viewer", "pool_view")  # blueprints a browser signs in to (app/viewer.py)


def _guard(app: Flask, cfg: Settings) -> None:
    """Optional bearer token and client allow-list (docs/settings.md); the probes stay open.
    With a tenants file, the token names the tenant (app/tenancy.py), whose requests see only
    its own runs and jobs."""
    networks = [ipaddress.ip_network(c, strict=False) for c in cfg.allowed_clients]

    @app.before_request
    def check_client():
        if request.path in PROBES:
            return None
        if networks and not _allowed(_client_address(), networks):
            return fail("FORBIDDEN", "client address not allowed", 403)
        who = tenancy.identify(cfg, request.headers.get("Authorization", ""))
        if who is tenancy.NOBODY and request.blueprint in BROWSER_PAGES:  # a browser: the login form
            who, login = viewer.browser_gate(cfg)  # and its cookie (app/viewer.py)
            if login is not None:
                return login
        if who is tenancy.NOBODY:
            return fail("UNAUTHORIZED", "missing or wrong bearer token", 401)
        g.tenant = who
        tenancy.disguise_path(app.extensions["termpool"].store)  # the one ownership check
        return None

    app.after_request(tenancy.unmask)


def _client_address():
    try:
        return ipaddress.ip_address(request.remote_addr or "")
    except ValueError:  # a peer without an IP address (a Unix socket)
        return None


def _allowed(addr, networks) -> bool:
    return addr is not None and any(addr in net for net in networks)


def _publish_build_limits(cfg: Settings, store: Store) -> None:
    """The tenants' max_builds, for the workers (tasks/build_quota.py), which have no tenants
    file. A facade that cannot write them now starts anyway: the last ones written hold."""
    if not cfg.tenants:
        return
    try:
        store.publish_build_limits(cfg.tenants.build_limits())
    except redis.RedisError as exc:
        log.warning("tenants' max_builds not published to Redis: %s", exc)


def create_app(cfg: Settings | None = None) -> Flask:
    cfg = cfg or settings()
    app = Flask(__name__, static_folder=None)
    app.json.sort_keys = False
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    celery = celery_init_app(app, cfg)
    store = Store.connect(cfg)
    engine = app.extensions["termpool"] = Engine(cfg=cfg, store=store, celery=celery)
    _publish_build_limits(cfg, store)
    engine.follower = follow_monitor(celery, cfg, Store.connect(cfg, timeout=5, wait_out=False))
    _guard(app, cfg)
    errors.register(app)

    from app import apidoc
    from app.archives_api import bp as archives_bp
    from app.commands_api import bp as commands_bp
    from app.metrics import init_metrics
    from app.pool_api import bp as pool_bp
    from app.runs_api import bp as runs_bp
    from app.tasks_api import bp as tasks_bp

    app.register_blueprint(pool_bp)
    app.register_blueprint(runs_bp)
    app.register_blueprint(tasks_bp)
    app.register_blueprint(commands_bp)
    app.register_blueprint(archives_bp)
    app.register_blueprint(viewer.bp)
    app.register_blueprint(pool_view.bp)
    init_metrics(app)
    apidoc.register(app)

    from cli.dataset import dataset_cli
    from cli.hosts import hosts_cli
    from cli.registry import registry_cli

    app.cli.add_command(dataset_cli)
    app.cli.add_command(hosts_cli)
    app.cli.add_command(registry_cli)
    return app


def stop_app(app: Flask) -> None:
    """Stop an app's background threads, for a process that goes on without it (a test):
    gunicorn's worker processes keep theirs to their end."""
    app.extensions["termpool"].stop()
    if "termpool_metrics" in app.extensions:
        app.extensions["termpool_metrics"]["recent"].stop()
