"""`flask --app app registry status|gc`: the pool's image registry (docs/operations.md, "A pool's
registry"). gc deletes the pool's images no host has pushed or pulled for REGISTRY_RETENTION_DAYS
(environments/registry_reclaim.py), then collects the embedded registry's freed blobs
(`docker-registry garbage-collect`; run it on the machine that serves the embedded registry).
"""

from __future__ import annotations

import click
from flask import current_app
from flask.cli import AppGroup

registry_cli = AppGroup("registry", help="The pool's image registry: see it, reclaim its storage.")


def _registry(with_usage: bool = False):
    # imported here: the facade, which registers these commands, loads no Docker code
    from environments.registry import Registry

    cfg = current_app.extensions["termpool"].cfg
    if not cfg.registry.enabled:
        raise click.ClickException("the pool's registry is off (REGISTRY_URL=off)")
    return Registry(cfg.registry, current_app.extensions["termpool"].store if with_usage else None)


@registry_cli.command("status")
def status() -> None:
    """Whether the registry answers, and the pool's repositories in it."""
    registry = _registry()
    if not registry.reachable():
        raise click.ClickException(f"registry {registry.address} does not answer at {registry.cfg.api}")
    repos = [repo for repo in registry.repositories() if repo.startswith("termpool/")]
    click.echo(f"registry {registry.address}: reachable, {len(repos)} repositories of the pool")


@registry_cli.command("gc")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
def gc(dry_run: bool) -> None:
    """Delete images unused for REGISTRY_RETENTION_DAYS, then collect the embedded one's blobs."""
    from environments import registry_server
    from environments.registry_reclaim import reclaim

    registry = _registry(with_usage=True)
    try:
        done = reclaim(registry, registry.usage, dry_run=dry_run)
        collected = registry_server.garbage_collect(registry.cfg, dry_run=dry_run)
    except (OSError, RuntimeError) as error:
        raise click.ClickException(str(error)) from None
    verb = "would delete" if dry_run else "deleted"
    for member in done.deleted:
        click.echo(f"{verb} {member}")
    click.echo(f"registry {registry.address}: {verb} {len(done.deleted)}, kept {done.kept}")
    click.echo(f"garbage-collect: {collected}")
    if done.failed:
        raise click.ClickException(f"{len(done.failed)} deletes refused: {', '.join(done.failed)}")
