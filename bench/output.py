"""A bench module's result as JSON: printed, and written to its --out file when given, with the
command line that made it (so a committed result says how to make it again)."""

from __future__ import annotations

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
