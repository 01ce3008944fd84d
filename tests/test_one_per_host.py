"""Tasks that allow one live run per host (poolcore/task_spec.py one_per_host): detection from
the raw compose file, the capped placement (a bare Redis), the 429's text, the warm pool's
skip and `dataset check`'s note. No dockerd: the episodes are in tests/test_fixed_subnet.py."""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app import engine
from app.engine import Engine
from app.refusal_texts import capacity_message
from devstack import FIXTURES
from poolcore import hosts
from poolcore.config import load_settings
from poolcore.state import CapacityError
from poolcore.task_spec import load_task, load_task_cached, one_per_host, one_per_host_reasons
from tasks import warm_pool
from tests import test_placement
from tests.test_dataset_cli import cli
from tests.test_placement import see

pytestmark = pytest.mark.unit
store, cfg, watch = test_placement.store, test_placement.cfg, test_placement.watch  # its fixtures: a bare Redis

TASK = "compose-fixed-subnet"
FIXTURE_REASONS = (
    "fixed subnet 10.231.0.0/24 (network 'labnet')",
    "static address 10.231.0.53 (service 'names')",
    "static address 10.231.0.20 (service 'records')",
    "static address 10.231.0.10 (service 'client')",
)


def service(**keys) -> dict:
    return {"services": {"web": {"image": "x", **keys}}}


# ---- detection ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("compose", "reasons"),
    [
        (
            {"networks": {"lab": {"ipam": {"config": [{"subnet": "172.20.0.0/16"}]}}}},
            ["fixed subnet 172.20.0.0/16 (network 'lab')"],
        ),
        (
            {"networks": {"lab": {"ipam": {"config": [{"ip_range": "172.20.5.0/24", "gateway": "172.20.5.254"}]}}}},
            ["fixed ip range 172.20.5.0/24 (network 'lab')", "fixed gateway 172.20.5.254 (network 'lab')"],
        ),
        (service(networks={"lab": {"ipv4_address": "172.20.0.5"}}), ["static address 172.20.0.5 (service 'web')"]),
        (service(networks={"lab": {"ipv6_address": "fd00::5"}}), ["static address fd00::5 (service 'web')"]),
        (service(ports=["8080:80"]), ["fixed host port 8080 (service 'web')"]),
        (service(ports=["127.0.0.1:9000-9001:80-81/udp"]), ["fixed host port 9000-9001 (service 'web')"]),
        (service(ports=["[::1]:2222:22"]), ["fixed host port 2222 (service 'web')"]),
        (service(ports=[{"target": 80, "published": 8081}]), ["fixed host port 8081 (service 'web')"]),
        (service(ports=["${WEB_PORT:-8080}:80"]), ["fixed host port ${WEB_PORT:-8080} (service 'web')"]),
        # Docker picks the host port: any number of runs per host.
        (service(ports=["80", 80, "127.0.0.1::80", "[::1]:80", {"target": 80}]), []),
        # Addresses Docker picks, aliases, a network's fixed name (termpool renames it per run).
        (
            {
                "networks": {"lab": {"name": "lab", "ipam": {"driver": "default"}}},
                **service(networks={"lab": {"aliases": ["w"]}, "other": None}),
            },
            [],
        ),
        ({"services": {"web": {"networks": ["lab"]}}}, []),
        ("not a mapping", []),
        ({"services": ["web"], "networks": {"lab": {"ipam": {"config": "x"}}}}, []),
    ],
)
def test_each_rule(compose, reasons):
    assert list(one_per_host(compose)) == reasons


def test_a_task_with_none_and_the_fixture(tmp_path):
    assert load_task(FIXTURES / "hello-file").one_per_host == ()
    assert load_task(FIXTURES / "compose-healthy-sidecar").one_per_host == ()  # fixed names: renamed per run
    assert load_task(FIXTURES / TASK).one_per_host == FIXTURE_REASONS


def test_unquoted_port_mappings_are_read_as_compose_reads_them(tmp_path):
    """YAML 1.1 reads `2222:22` as a base-60 number; compose (YAML 1.2) as a mapping."""
    task = shutil.copytree(FIXTURES / "hello-file", tmp_path / "task")
    compose = task / "docker-compose.yaml"
    compose.write_text(compose.read_text() + "    ports:\n      - 2222:22\n      - 80\n")
    assert load_task(task).one_per_host == ("fixed host port 2222 (service 'client')",)


def test_the_cache_sees_a_compose_file_change_and_a_broken_task_still_answers(tmp_path):
    task = shutil.copytree(FIXTURES / "hello-file", tmp_path / "task")
    compose = task / "docker-compose.yaml"
    first = load_task_cached(task)
    assert first.one_per_host == () and load_task_cached(task) is first
    compose.write_text(compose.read_text() + "    ports: [ '8080:80' ]\n")
    assert load_task_cached(task).one_per_host == ("fixed host port 8080 (service 'client')",)
    (task / "task.yaml").write_text("difficulty: easy\n")  # no instruction: load_task refuses it
    assert one_per_host_reasons(task) == ("fixed host port 8080 (service 'client')",)
    compose.write_text("services: [ unclosed\n")
    assert one_per_host_reasons(task) == ()  # the start says what is wrong


# ---- the facade: which task a key names -----------------------------------------------------
def facade_of(dataset: Path) -> SimpleNamespace:
    """What Engine.one_per_host reads of an engine: its settings and its kept answers."""
    facade = SimpleNamespace(cfg=load_settings({"DATASET_DIR": str(dataset)}), reasons={})
    facade.read_one_per_host = functools.partial(Engine.read_one_per_host, facade)
    return facade


def test_the_facade_finds_the_task_by_path_or_key():
    facade = facade_of(FIXTURES)
    assert Engine.one_per_host(facade, TASK) == FIXTURE_REASONS
    assert Engine.one_per_host(facade, str(FIXTURES / TASK)) == FIXTURE_REASONS
    for key in ("hello-file", "no-such-task", "../fixtures/" + TASK, "/etc", "x" * 300, "a\x00b", ""):
        assert Engine.one_per_host(facade, key) == (), key


def test_the_facade_keeps_an_answer_for_a_moment(tmp_path, monkeypatch):
    """Read once per REASONS_TTL, not on every allocate; an edited folder counts after that."""
    task = shutil.copytree(FIXTURES / "hello-file", tmp_path / "task")
    facade = facade_of(tmp_path)
    assert Engine.one_per_host(facade, "task") == ()
    compose = task / "docker-compose.yaml"
    compose.write_text(compose.read_text() + "    ports: [ '8080:80' ]\n")
    assert Engine.one_per_host(facade, "task") == ()  # kept
    later = time.monotonic() + engine.REASONS_TTL + 1
    monkeypatch.setattr(engine.time, "monotonic", lambda: later)
    assert Engine.one_per_host(facade, "task") == ("fixed host port 8080 (service 'client')",)


# ---- placement ------------------------------------------------------------------------------
def place(store, cfg, watch, key=TASK, cap=1, request_id=""):
    watch.poll()
    return store.place(key, request_id, key, hosts.placement(cfg, watch, runs_per_host=cap))


def test_one_run_per_host_then_429(store, cfg, watch):
    see(store, watch, "a")
    see(store, watch, "b")
    first, second = place(store, cfg, watch), place(store, cfg, watch)
    assert {first.host, second.host} == {"a", "b"}
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch)
    assert raised.value.code == "RUN_SLOTS_EXHAUSTED"
    # Other keys are not capped, and the same key uncapped still has the host's own slots.
    assert place(store, cfg, watch, key="other", cap=0).host in ("a", "b")
    assert place(store, cfg, watch, cap=0).host in ("a", "b")
    # An idempotent repeat is the same lease, not a second run.
    again = place(store, cfg, watch, key="k", request_id="r")
    assert place(store, cfg, watch, key="k", request_id="r").run_id == again.run_id


def test_a_run_being_torn_down_holds_its_host(store, cfg, watch):
    see(store, watch, "a")
    run = place(store, cfg, watch)
    assert store.release(run.run_id)  # closing: its containers may still hold the subnet
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch)
    assert raised.value.code == "RUN_SLOTS_EXHAUSTED"
    assert place(store, cfg, watch, key="other").host == "a"  # another key's teardown is no matter
    store.mark_closed(run.run_id)  # the teardown ended
    assert place(store, cfg, watch).host == "a"


def test_task_slots_still_count(store, cfg, watch):
    see(store, watch, "a", max_tasks=1)
    place(store, cfg, watch, key="other", cap=0)
    with pytest.raises(CapacityError) as raised:
        place(store, cfg, watch)
    assert raised.value.code == "TASK_SLOTS_EXHAUSTED"


def test_the_429_says_why():
    message = capacity_message(TASK, "RUN_SLOTS_EXHAUSTED", FIXTURE_REASONS)
    assert message.startswith(
        f"no capacity for task '{TASK}': it allows one live run per host (fixed subnet 10.231.0.0/24"
    )
    assert "and 1 more" in message and "teardown" in message
    message = capacity_message(TASK, "TASK_SLOTS_EXHAUSTED", FIXTURE_REASONS[:1])
    assert "WORKER_MAX_TASKS" in message and "fixed subnet 10.231.0.0/24 (network 'labnet')" in message
    assert (
        capacity_message(TASK, "RUN_SLOTS_EXHAUSTED")
        == f"no capacity for task '{TASK}': WORKER_MAX_RUNS_PER_TASK reached"
    )


# ---- warm pool, dataset check ---------------------------------------------------------------
def test_the_warm_pool_keeps_no_spares_of_such_a_task(monkeypatch, caplog):
    monkeypatch.setattr(warm_pool, "settings", lambda: load_settings({"DATASET_DIR": str(FIXTURES)}))
    monkeypatch.setattr(warm_pool, "store", lambda: pytest.fail("sized without Redis"))
    warm_pool.NOT_POOLED.discard(TASK)
    with caplog.at_level("INFO", logger=warm_pool.log.name):
        assert warm_pool.target_size("h", TASK) == 0
        assert warm_pool.target_size("h", TASK) == 0
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "allows one live run per host (fixed subnet 10.231.0.0/24" in logged[0]


def test_dataset_check_lists_it_apart_from_problems(tmp_path):
    data = tmp_path / "ds"
    shutil.copytree(FIXTURES / TASK, data / TASK)
    shutil.copytree(FIXTURES / "hello-file", data / "hello-file")
    run = cli(tmp_path)
    result = run("check", data)
    assert result.exit_code == 0, result.output
    rows = [line.split(None, 1) for line in result.stdout.splitlines()]
    assert [TASK, "fixed subnet 10.231.0.0/24 (network 'labnet')"] in rows
    assert "2 clean, 0 with problems. 1 allow one live run per host." in result.stdout
    report = json.loads(run("check", data, "--json").stdout)
    assert report["ok"] and report["problems"] == []
    assert report["one_per_host"] == [{"task": TASK, "reason": why} for why in FIXTURE_REASONS]
