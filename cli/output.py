"""Printing for the dataset commands: plain tables on stdout, progress bars on stderr."""

from __future__ import annotations

import json
import sys

import click


def progress(length: int, label: str, hidden: bool = False, item_show_func=None):
    """A progress bar on stderr, so stdout stays a clean table (or JSON) to pipe."""
    return click.progressbar(
        length=length, label=label, file=sys.stderr, hidden=hidden, show_pos=True, item_show_func=item_show_func
    )


def shorten(text, width: int = 100) -> str:
    """One line of at most width characters."""
    line = " ".join(("" if text is None else str(text)).split())
    return line if len(line) <= width else line[: width - 3] + "..."


def table(headers: list[str], rows: list[list], max_width: int = 100) -> None:
    """Columns padded to their widest cell; the last column is cut at max_width."""
    cells = [[str(c) for c in headers]] + [[shorten(c, max_width) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        click.echo(
            "  ".join(cell.ljust(widths[i]) if i < len(row) - 1 else cell for i, cell in enumerate(row)).rstrip()
        )
        if n == 0:
            click.echo("  ".join("-" * w for w in widths))


def emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))
