"""The pytest parser and scoring, per docs/task-format.md "The pytest parser"."""

import pytest

from poolcore.pytest_parser import (
    PARSERS,
    ParseError,
    UnknownParser,
    get_parser,
    parse_pytest,
    score,
)

pytestmark = pytest.mark.unit

# Real output of `pytest -rA` (pytest 7) over a file with every kind of outcome.
MIXED_OUTPUT = """\
============================= test session starts ==============================
platform linux -- Python 3.11.2, pytest-7.2.1, pluggy-1.0.0+repack
rootdir: /tests
collected 9 items

../tests/test_outputs.py .F.sxXE.F                                       [100%]

==================================== ERRORS ====================================
_________________________ ERROR at setup of test_error _________________________
    def broken(): raise RuntimeError("fixture broke")
E   RuntimeError: fixture broke
=================================== FAILURES ===================================
___________________________________ test_bad ___________________________________
E   AssertionError: one is not two - really
==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_ok
PASSED ../tests/test_outputs.py::test_param[a b]
PASSED ../tests/test_outputs.py::TestGroup::test_inner
SKIPPED [1] ../tests/test_outputs.py:5: not today
XFAIL ../tests/test_outputs.py::test_xfail - known bug
XPASS ../tests/test_outputs.py::test_xpass - should fail
ERROR ../tests/test_outputs.py::test_error - RuntimeError: fixture broke
FAILED ../tests/test_outputs.py::test_bad - AssertionError: one is not two - really
FAILED ../tests/test_outputs.py::test_param[c-d] - AssertionError: assert 'c-d' != 'c-d'
==== 2 failed, 3 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 0.60s =====
"""


def test_mixed_output_follows_the_spec_rules():
    assert parse_pytest(MIXED_OUTPUT) == {
        "test_ok": "passed",
        "test_param[a b]": "passed",  # only the first whitespace splits
        "TestGroup::test_inner": "passed",  # the name is everything after the first ::
        "[1] ../tests/test_outputs.py:5: not today": "passed",  # SKIPPED, no :: in it
        "test_xfail - known bug": "passed",  # only FAILED lines are cut at " - "
        "test_xpass - should fail": "failed",
        "test_error - RuntimeError: fixture broke": "failed",
        "test_bad - AssertionError: one is not two": "failed",  # cut at the LAST " - "
        "test_param[c-d]": "failed",
    }


def test_mixed_output_score():
    assert score(parse_pytest(MIXED_OUTPUT)) == pytest.approx(5 / 9)


def test_all_passed():
    out = "=== short test summary info ===\nPASSED t.py::test_a\nPASSED t.py::test_b\n"
    tests = parse_pytest(out)
    assert tests == {"test_a": "passed", "test_b": "passed"}
    assert score(tests) == 1.0


def test_only_text_after_the_first_summary_line_counts():
    out = (
        "PASSED t.py::test_before\n"
        "== short test summary info ==\n"
        "FAILED t.py::test_a - boom\n"
        "== short test summary info ==\n"  # a second header is just an ignored line
        "PASSED t.py::test_b\n"
    )
    assert parse_pytest(out) == {"test_a": "failed", "test_b": "passed"}


def test_header_is_case_insensitive_and_spacing_free():
    assert parse_pytest("=SHORT TEST SUMMARY INFO=\nPASSED a.py::t\n") == {"t": "passed"}
    assert parse_pytest("===short test summary info===\nPASSED a.py::t\n") == {"t": "passed"}
    assert parse_pytest("==  Short Test Summary Info  ==\nPASSED a.py::t\n") == {"t": "passed"}


@pytest.mark.parametrize(
    "output",
    [
        "",
        "bash: python3: command not found\n",
        "collected 0 items\n\n=== no tests ran in 0.01s ===\n",
        "short test summary info\nPASSED a.py::t\n",  # no = around it
        "PASSED a.py::t\n",
    ],
)
def test_no_summary_line_is_a_parse_error(output):
    with pytest.raises(ParseError, match="short test summary info"):
        parse_pytest(output)


def test_parse_error_is_a_value_error():
    assert issubclass(ParseError, ValueError)


def test_non_text_output_is_a_parse_error():
    with pytest.raises(ParseError):
        parse_pytest(None)  # type: ignore[arg-type]


def test_summary_with_no_result_lines_parses_to_nothing_and_scores_zero():
    tests = parse_pytest("=== short test summary info ===\n=== 0 passed ===\n")
    assert tests == {}
    assert score(tests) == 0.0


def test_status_with_colon_and_unknown_status_words():
    out = (
        "=== short test summary info ===\n"
        "PASSED: a.py::test_colon\n"
        "passed a.py::test_lowercase\n"  # status words are upper case
        "WARNING a.py::test_warn\n"
        "PASSED\n"  # fewer than two parts
        "   \n"
        "ERROR: a.py::test_err\n"
    )
    assert parse_pytest(out) == {"test_colon": "passed", "test_err": "failed"}


def test_later_line_overrides_earlier():
    out = (
        "=== short test summary info ===\n"
        "FAILED a.py::test_flaky - first try\n"
        "PASSED a.py::test_flaky\n"
        "PASSED a.py::test_other\n"
        "ERROR a.py::test_other\n"
    )
    assert parse_pytest(out) == {"test_flaky": "passed", "test_other": "failed"}


def test_failed_without_message_is_not_cut():
    out = "=== short test summary info ===\nFAILED a.py::test_x\n"
    assert parse_pytest(out) == {"test_x": "failed"}


def test_name_without_double_colon_is_the_whole_rest():
    out = "=== short test summary info ===\nERROR test_outputs.py\nPASSED plain_name\n"
    assert parse_pytest(out) == {"test_outputs.py": "failed", "plain_name": "passed"}


def test_windows_line_endings():
    out = "=== short test summary info ===\r\nPASSED a.py::test_a\r\nFAILED a.py::test_b - x\r\n"
    assert parse_pytest(out) == {"test_a": "passed", "test_b": "failed"}


def test_leading_whitespace_lines():
    out = "=== short test summary info ===\n  PASSED a.py::test_a\n"
    assert parse_pytest(out) == {"test_a": "passed"}


def test_score_fractions():
    assert score({}) == 0.0
    assert score({"a": "failed"}) == 0.0
    assert score({"a": "passed", "b": "failed", "c": "failed", "d": "passed"}) == 0.5
    assert score({"a": "passed", "b": "passed", "c": "passed", "d": "failed"}) == 0.75


def test_parser_registry():
    assert {"pytest": parse_pytest} == PARSERS
    assert get_parser("pytest") is parse_pytest


@pytest.mark.parametrize("name", ["swebench", "swelancer", "mlebench", "sweperf", "", "PYTEST", None, ["pytest"]])
def test_unknown_parser(name):
    with pytest.raises(UnknownParser) as info:
        get_parser(name)
    assert "unknown parser_name" in str(info.value)
    assert "pytest" in str(info.value)
    assert isinstance(info.value, ValueError)
