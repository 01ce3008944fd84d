"""The per-process memory of whose each run is (app/tenancy.py Owners): what it keeps and drops."""

import pytest

from app.tenancy import Owners
from poolcore.tenants import Tenant

pytestmark = pytest.mark.unit


def test_keeps_what_it_was_told_and_drops_the_oldest_past_its_size():
    owners = Owners(size=2)
    owners.put((False, "run-a"), "alpha")
    owners.put((True, "job-b"), "")
    assert owners.get((False, "run-a")) == "alpha" and owners.get((True, "job-b")) == ""
    owners.put((False, "run-c"), "gamma")
    assert owners.get((False, "run-a")) is None  # the oldest went first
    assert owners.get((True, "job-b")) == "" and owners.get((False, "run-c")) == "gamma"


def test_a_run_made_names_its_tenant_or_the_operator():
    owners = Owners(size=10)
    owners.made("run-1", Tenant(name="trainer", token="t"))
    owners.made("run-2", None)
    assert owners.get((False, "run-1")) == "trainer"
    assert owners.get((False, "run-2")) == ""  # the operator's, as Store.run_owner says it
    assert owners.get((True, "run-1")) is None  # a job id is another key
