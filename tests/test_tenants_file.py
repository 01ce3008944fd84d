"""The tenants file (poolcore/tenants.py): what it accepts, and every refusal naming its line."""

from __future__ import annotations

import os

import pytest

from poolcore.config import load_settings
from poolcore.tenants import TenantsFileError, load, parse

pytestmark = pytest.mark.unit

GOOD = """\
tenants:
  trainer-a:
    token: tok-aaaaaaaaaaaa
    max_runs: 8
    reserved_runs: 2
    priority: train
    max_builds: 2
    max_upload_bytes: 10_000_000
  eval_b:
    token: "tok-bbbbbbbbbbbb"
    priority: eval
"""


def test_a_good_file():
    tenants = parse(GOOD, "t.yaml")
    a, b = tenants.by_name["trainer-a"], tenants.by_name["eval_b"]
    assert (a.max_runs, a.reserved_runs, a.priority) == (8, 2, "train")
    assert (b.max_runs, b.reserved_runs, b.priority) == (None, 0, "eval")
    assert (a.max_builds, a.max_upload_bytes) == (2, 10_000_000) and (b.max_builds, b.max_upload_bytes) == (None, None)
    assert tenants.build_limits() == {"trainer-a": 2}
    assert tenants.for_token("tok-aaaaaaaaaaaa") is a and tenants.for_token("nope") is None
    assert tenants.reservations() == {"trainer-a": 2}


def test_tokens_never_in_reprs():
    tenants = parse(GOOD, "t.yaml")
    for text in (repr(tenants), repr(tenants.by_name["trainer-a"]), str(tenants.by_name)):
        assert "tok-" not in text


BAD = [
    # (file text, line named, words in the message)
    ("tenants:\n  a: {token: x\n", 3, "not valid YAML"),
    ("tenants:\n  a:\n    token: same\n  b:\n    token: same\n", 5, "has the token of tenant 'a'"),
    ("tenants:\n  a:\n    token: t1\n    max_runs: ten\n", 4, "max_runs must be a non-negative integer"),
    ("tenants:\n  a:\n    token: t1\n    max_runs: -1\n", 4, "non-negative integer"),
    ("tenants:\n  a:\n    token: t1\n    max_runs: 2.5\n", 4, "non-negative integer"),
    ("tenants:\n  a:\n    token: t1\n    reserved_runs: true\n", 4, "reserved_runs must be"),
    ("tenants:\n  a:\n    token: t1\n    max_runs: 2\n    reserved_runs: 3\n", 5, "above max_runs"),
    ("tenants:\n  a:\n    token: t1\n    max_run: 2\n", 4, "unknown key 'max_run'"),
    ("tenants:\n  a:\n    token: t1\n    max_builds: two\n", 4, "max_builds must be a non-negative integer"),
    ("tenants:\n  a:\n    token: t1\n    max_builds: -2\n", 4, "max_builds must be"),
    ("tenants:\n  a:\n    token: t1\n    max_upload_bytes: 1.5e9\n", 4, "max_upload_bytes must be"),
    ("tenants:\n  a:\n    token: t1\n\n    max_upload_bytes: 10MB\n", 5, "max_upload_bytes must be"),
    ("tenants:\n  a:\n    token: t1\n    max_build: 1\n", 4, "unknown key 'max_build'"),
    ("tenants:\n  a:\n    token: t1\n    priority: urgent\n", 4, "priority must be one of"),
    ('tenants:\n  "bad\\u0007name":\n    token: t1\n', 2, "not a safe identifier"),
    ("tenants:\n  a b:\n    token: t1\n", 2, "not a safe identifier"),
    ("tenants:\n  a:\n    max_runs: 1\n", 3, "has no token"),
    ("tenants:\n  a:\n    token: 'has space'\n", 3, "token must be printable"),
    ("tenants:\n  a:\n    token: 12345\n", 3, "token must be printable"),
    ("tenants:\n  a:\n    token: t1\n  a:\n    token: t2\n", 4, "appears twice"),
    ("tenant:\n  a:\n    token: t1\n", 1, "one key, `tenants`"),
    ("tenants:\n  - a\n", 2, "must be a mapping"),
    ("tenants: {}\n", 1, "names no tenant"),
    ("\n", 1, "empty tenants file"),
]


@pytest.mark.parametrize("text, line, words", BAD)
def test_refusals_name_the_file_and_line(text, line, words):
    with pytest.raises(TenantsFileError) as caught:
        parse(text, "/etc/termpool/tenants.yaml")
    message = str(caught.value)
    assert message.startswith(f"/etc/termpool/tenants.yaml:{line}:"), message
    assert words in message
    assert "same" not in message and "t1" not in message  # a token is never echoed


def test_the_operators_token_is_not_a_tenants():
    with pytest.raises(TenantsFileError, match=r"t\.yaml:3: tenant 'a' has the operator's token"):
        parse("tenants:\n  a:\n    token: admin-token\n", "t.yaml", admin_token="admin-token")


def test_settings_refuse_a_bad_file(tmp_path):
    """The service's start: settings are loaded first, and a bad file stops it there."""
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  a:\n    token: t1\n    max_runs: many\n")
    with pytest.raises(TenantsFileError, match=rf"{path}:4:"):
        load_settings({**os.environ, "TENANTS_FILE": str(path)})
    with pytest.raises(TenantsFileError, match="cannot read"):
        load(str(tmp_path / "missing.yaml"))


def test_no_file_is_one_tenant():
    cfg = load_settings({k: v for k, v in os.environ.items() if k != "TENANTS_FILE"})
    assert not cfg.tenants and cfg.tenants.reservations() == {}
