"""A bench module's result as JSON: printed, and written to its --out file when given, with the
command line that made it (so a committed result says how to make it again)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def emit(module: str, result: dict, out: str | Path | None) -> None:
    """Print `result` (with its command: `python -m <module>` and this process's arguments) as
    JSON, and write the same text to `out` if given."""
    text = json.dumps({"command": shlex.join(["python", "-m", module, *sys.argv[1:]]), **result}, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def parse_stack_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse with the options every stack benchmark shares: --env (extra stack environment,
    as args.extra_env) and --out (where results go)."""
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra stack environment")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    args.extra_env = dict(item.split("=", 1) for item in args.env)
    return args
