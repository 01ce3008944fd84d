"""`flask --app app hosts list|drain|undrain HOST`: see and take worker hosts out of service.

A draining host takes no new runs; its live runs go on until they are closed (or reaped), so
once `hosts list` shows it with no live runs its workers can be stopped. Undrain puts it back.
"""

from __future__ import annotations

import json
import time

import click
from flask import current_app
from flask.cli import AppGroup

from poolcore.hosts import look

hosts_cli = AppGroup("hosts", help="List worker hosts, drain one or put it back in service.")


def _engine():
    return current_app.extensions["termpool"]


def _age(at: float | None) -> str:
    return "never" if at is None else f"{time.time() - at:.0f} s ago"


@hosts_cli.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON (as /status has them).")
def list_hosts(as_json: bool) -> None:
    """Every known worker host: state, capacity, live runs, images cached, last heartbeat."""
    look(_engine().watch)  # judge only what this process saw: a heartbeat's time
    hosts = _engine().host_overview()
    if as_json:
        click.echo(json.dumps(hosts, indent=2))
        return
    click.echo(f"{'HOST':<24} {'STATE':<13} {'LIVE/CAPACITY':<14} {'IMAGES':<7} {'LAST HEARTBEAT'}")
    for host, info in hosts.items():
        cap = info["capacity"]["max_tasks"] * info["capacity"]["max_runs_per_task"]
        click.echo(
            f"{host:<24} {info['state']:<13} {info['live_runs']}/{cap:<12} {info['images_cached']:<7} "
            f"{_age(info['last_heartbeat'])}"
        )


@hosts_cli.command("drain")
@click.argument("host")
def drain(host: str) -> None:
    """Place no new runs on HOST; its live runs finish normally."""
    _engine().store.set_draining(host, True)
    known = host in _engine().host_overview()
    click.echo(f"{host} is draining" + ("" if known else " (no worker of it has been heard from yet)"))


@hosts_cli.command("undrain")
@click.argument("host")
def undrain(host: str) -> None:
    """Put HOST back in service."""
    _engine().store.set_draining(host, False)
    click.echo(f"{host} takes new runs again")
