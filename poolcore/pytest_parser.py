"""Turn a test script's output into per-test results and a score (docs/task-format.md).

Pure logic, no I/O. The only parser the pool has is ``pytest``: it reads the
``short test summary info`` section that ``pytest -rA`` prints, one line per test.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

PASSED = "passed"
FAILED = "failed"

# Status word at the start of a summary line -> outcome.
_OUTCOMES = {
    "PASSED": PASSED,
    "SKIPPED": PASSED,
    "XFAIL": PASSED,
    "FAILED": FAILED,
    "XPASS": FAILED,
    "ERROR": FAILED,
}

_SUMMARY_HEADER = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)


class ParseError(ValueError):
    """The output holds no results that can be read (not the same as a score of 0)."""


class UnknownParser(ValueError):
    """A task names a parser this pool does not have."""


def parse_pytest(output: str) -> dict[str, str]:
    """Map test name -> "passed"/"failed" from the short test summary of ``pytest -rA``.

    Only the text after the first ``=== short test summary info ===`` line counts; no
    such line raises ParseError. A later line for the same test overrides an earlier one.
    """
    if not isinstance(output, str):
        raise ParseError(f"test output must be text, not {type(output).__name__}")
    lines = output.splitlines()
    start = None
    for index, line in enumerate(lines):
        if _SUMMARY_HEADER.search(line):
            start = index + 1
            break
    if start is None:
        raise ParseError(
            "no 'short test summary info' line in the test output (did the tests run, and with pytest -rA?)"
        )

    results: dict[str, str] = {}
    for line in lines[start:]:
        if line.startswith("FAILED") and " - " in line:
            line = line[: line.rindex(" - ")]
        parts = line.split(maxsplit=1)
        if len(parts) < 2:
            continue
        outcome = _OUTCOMES.get(parts[0].strip(":"))
        if outcome is None:
            continue
        test_path = parts[1].strip()
        name = test_path.split("::", 1)[1] if "::" in test_path else test_path
        name = name.strip()
        if name:
            results[name] = outcome
    return results


def score(tests: Mapping[str, str]) -> float:
    """The fraction of parsed tests that passed; 0.0 when nothing was parsed."""
    if not tests:
        return 0.0
    passed = sum(1 for outcome in tests.values() if outcome == PASSED)
    return passed / len(tests)


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {"pytest": parse_pytest}


def get_parser(name: str) -> Callable[[str], dict[str, str]]:
    """The parse function for a task's ``parser_name``; UnknownParser for any other name."""
    try:
        return PARSERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(PARSERS))
        raise UnknownParser(
            f"unknown parser_name {name!r}: this pool can only grade tasks with parser_name: {known}"
        ) from None
