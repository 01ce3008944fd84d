"""One pool over two worker hosts: the stack's own workers on the machine's dockerd (host A)
and a second host's workers on a second dockerd (host B, tests/second_docker.py), one Redis,
one facade. Placement spreads runs, each run's containers live on its own host's daemon,
a host killed with -9 is reported HOST_LOST at once, comes back and cleans up, a drained
host takes no runs, and a task pinning a subnet gets one live run per host. The tests run in file order on one module stack."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from devstack import ROOT, Stack
from poolcore.config import load_settings
from poolcore.state import Store
from tests.conftest import Router, held_by_pool, run_containers, stop_checking_leaks, wait_for
from tests.second_docker import second_docker  # noqa: F401 (the fixture)

TASK = "hello-file"
EPISODES = 16
AT_ONCE = 8
LOSS_ANSWER_LIMIT = 20.0  # seconds from kill -9 to a HOST_LOST answer (the bound)


@pytest.fixture(scope="module")
def pool(second_docker, docker_client):  # noqa: F811 (the fixture imported above)
    # Capacity 4 x 8 per host: AT_ONCE runs are a quarter of it, so load decides placement.
    env = {"WORKER_MAX_TASKS": "4", "WORKER_MAX_RUNS_PER_TASK": "8", "EXEC_CONCURRENCY": "8"}
    stack = Stack(env=env, beat=True).start()
    host_b = "b" + uuid.uuid4().hex[:8]
    stack.start_host(host_b, second_docker.host_env())
    stack.host_b = host_b
    yield stack
    second = second_docker.client()
    try:
        stop_checking_leaks(stack, docker_client)
        left = leftovers(second, host_b)
        assert not left, f"containers left on the second daemon: {left}"
    finally:
        second.close()


@pytest.fixture(scope="module")
def router(pool) -> Router:
    return Router(pool)


@pytest.fixture(scope="module")
def daemons(pool, second_docker, docker_client):  # noqa: F811
    """Docker client by host id."""
    second = second_docker.client()
    yield {pool.host_id: docker_client, pool.host_b: second}
    second.close()


def store(stack: Stack) -> Store:
    return Store.from_url(stack.env["REDIS_URL"])


def hosts_cli(stack: Stack, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "app", "hosts", *args],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def host_of(stack: Stack, lease: str) -> str:
    return store(stack).get_run(lease)["host"]


def leftovers(client, host: str, stack: Stack | None = None) -> list[str]:
    """Names of the host's termpool containers (teardowns may remove some while listing); with
    `stack` (still up), not the warm pool's spares."""
    found = client.containers.list(all=True, filters={"label": f"termpool.host={host}"}, ignore_removed=True)
    return [c.name for c in found if stack is None or not held_by_pool(store(stack), c)]


def run_labels(client, lease: str, stack: Stack) -> list:
    return run_containers(client, store(stack), lease)


def episode(router: Router, daemons: dict, request_id: str | None = None) -> tuple[str, float]:
    """A solved episode; checks its containers are on its own host's daemon only."""
    lease = router.allocate(TASK, request_id)
    reply = router.reset(lease, TASK)
    assert reply.status_code == 200, reply.text
    host = host_of(router.stack, lease)
    for daemon_host, client in daemons.items():
        found = run_labels(client, lease, router.stack)
        assert bool(found) == (daemon_host == host), (lease, host, daemon_host, found)
    router.solve(lease, TASK)
    reply = router.evaluate(lease)
    assert reply.status_code == 200, reply.text
    router.close(lease)
    return host, reply.json()["score"]


def warm_up(stack: Stack, router: Router, daemons: dict, host: str) -> None:
    """Build the task's images on `host` (the others drained meanwhile)."""
    others = [h for h in daemons if h != host]
    for other in others:
        hosts_cli(stack, "drain", other)
    try:
        assert episode(router, daemons)[0] == host
    finally:
        for other in others:
            hosts_cli(stack, "undrain", other)


def test_episodes_spread_over_both_hosts(pool, router, daemons):
    for host in daemons:  # both hosts have the images: placement goes by load alone
        warm_up(pool, router, daemons, host)
    with ThreadPoolExecutor(AT_ONCE) as workers:
        results = list(workers.map(lambda _: episode(router, daemons), range(EPISODES)))
    placed = [host for host, _ in results]
    print(f"placement of {EPISODES} episodes at {AT_ONCE} at once: {dict(Counter(placed))}")
    assert all(score == 1.0 for _, score in results), results
    for host in daemons:
        assert placed.count(host) >= EPISODES // 4, placed
    status = pool.get("/status").json()["pool"]["hosts"]
    for host in daemons:
        assert status[host]["state"] == "serving" and status[host]["images_cached"] >= 1, status[host]
        assert status[host]["capacity"] == {"max_tasks": 4, "max_runs_per_task": 8}
    assert wait_for(lambda: all(not leftovers(client, host, pool) for host, client in daemons.items()), 90)


def test_idempotent_allocate_returns_the_same_lease_on_either_host(pool, router, daemons):
    leases = {}
    for host in daemons:
        others = [h for h in daemons if h != host]
        for other in others:
            hosts_cli(pool, "drain", other)
        request_id = uuid.uuid4().hex
        leases[request_id] = router.allocate(TASK, request_id)
        assert host_of(pool, leases[request_id]) == host
        for other in others:
            hosts_cli(pool, "undrain", other)
    for request_id, lease in leases.items():
        reply = pool.post("/allocate", {"task_key": TASK, "request_id": request_id}).json()
        assert reply["lease_id"] == lease and reply["reused"] is True, reply
        router.close(lease)


def test_host_killed_answers_host_lost_then_comes_back(pool, router, daemons):
    a, b = pool.host_id, pool.host_b
    call = {"name": "shell_exec", "arguments": {"id": "main", "command": "sleep 120", "block": True, "timeout": 180}}
    hosts_cli(pool, "drain", a)
    try:
        lease = router.allocate(TASK)  # pool API
        episode_reply = pool.post(  # runs API: a whole episode
            "/v1/runs", {"task_meta": {"task_name": TASK}, "script": [call], "evaluate": True, "close": True}
        )
    finally:
        hosts_cli(pool, "undrain", a)
    assert host_of(pool, lease) == b
    assert episode_reply.status_code == 202, episode_reply.text
    run_id, (tool_job,) = episode_reply.json()["run_id"], episode_reply.json()["jobs"]["tool_calls"]
    assert host_of(pool, run_id) == b
    assert router.reset(lease, TASK).status_code == 200
    with ThreadPoolExecutor(1) as background:
        pending = background.submit(lambda: pool.post("/exec_tool", {"lease_id": lease, "tool_call": call}))
        assert wait_for(lambda: store(pool).shown_run(lease)["state"] == "busy", 60, 0.1)
        assert wait_for(lambda: store(pool).job_state(tool_job) == "running", 120, 0.1)
        pool.kill_host(b)
        killed = time.monotonic()
        reply = pending.result(timeout=120)
    answered = time.monotonic() - killed
    print(f"a call waiting on the killed host answered {reply.status_code} after {answered:.1f} s")
    assert reply.status_code == 503 and reply.json()["code"] == "HOST_LOST", reply.text
    assert answered < LOSS_ANSWER_LIMIT, answered
    job = pool.get(f"/v1/jobs/{tool_job}?wait=30").json()["job"]
    assert job["state"] == "failed" and job["code"] == "HOST_LOST", job
    reply = pool.post(f"/v1/runs/{run_id}/tool_calls", call)
    assert reply.status_code == 503 and reply.json()["code"] == "HOST_LOST", reply.text

    # Every call on B's run now fails at once; the run left B's capacity.
    started = time.monotonic()
    reply = pool.post("/exec_tool", {"lease_id": lease, "tool_call": call})
    assert reply.status_code == 503 and reply.json()["code"] == "HOST_LOST", reply.text
    assert time.monotonic() - started < 5
    assert store(pool).get_run(lease)["state"] == "lost"
    status = pool.get("/status").json()["pool"]["hosts"][b]
    assert status["state"] == "lost" and status["live_runs"] == 0 and status["total_active_runs"] == 0, status
    assert run_labels(daemons[b], lease, pool), "B's containers stay until B is back"

    # New runs go to A and succeed.
    for _ in range(3):
        assert episode(router, daemons)[0] == a

    # B comes back: its reconcile removes the lost run's containers, and it takes runs again.
    pool.start_host(b)
    for lost in (lease, run_id):
        assert wait_for(lambda r=lost: not run_labels(daemons[b], r, pool), 120), "B's orphans were not removed"
        assert store(pool).get_run(lost)["state"] == "closed"
    warm_up(pool, router, daemons, b)


def test_a_drained_host_takes_no_new_runs(pool, router, daemons):
    a, b = pool.host_id, pool.host_b
    hosts_cli(pool, "drain", b)
    try:
        live_on_a = router.allocate(TASK)  # a live run on A goes on normally while A drains
    finally:
        hosts_cli(pool, "undrain", b)
    assert host_of(pool, live_on_a) == a and router.reset(live_on_a, TASK).status_code == 200
    out = hosts_cli(pool, "drain", a)
    assert "draining" in out
    listing = hosts_cli(pool, "list")
    assert any(line.split()[:2] == [a, "draining"] for line in listing.splitlines()), listing
    assert pool.get("/status").json()["pool"]["hosts"][a]["state"] == "draining"
    leases = []
    try:
        leases += [router.allocate(TASK) for _ in range(6)]
        assert {host_of(pool, lease) for lease in leases} == {b}
        assert router.sh(live_on_a, "echo still here") == "still here\n"
    finally:
        hosts_cli(pool, "undrain", a)
        for lease in [*leases, live_on_a]:
            router.close(lease)
    assert "draining" not in hosts_cli(pool, "list")
    assert wait_for(lambda: all(not leftovers(client, host, pool) for host, client in daemons.items()), 90)


def test_a_queue_without_live_workers_fails_fast(pool, router, daemons):
    """Single-host case of the same rule: the eval workers of a run's host, seen serving, fall
    silent -> WORKERS_DOWN once silent past HOST_SILENCE_SECONDS, not at the call's time limit;
    the host's other kinds keep serving. A clean stop is judged like any silence: a worker
    restarted by a deploy beats again within the limit and nothing fails meanwhile."""
    a = pool.host_id
    hosts_cli(pool, "drain", pool.host_b)
    try:
        lease = router.allocate(TASK)
    finally:
        hosts_cli(pool, "undrain", pool.host_b)
    try:
        assert host_of(pool, lease) == a and router.reset(lease, TASK).status_code == 200
        pool.kill("eval", sig=15)
        try:
            started = time.monotonic()
            reply = router.evaluate(lease)
            assert reply.status_code == 503 and reply.json()["code"] == "WORKERS_DOWN", reply.text
            assert time.monotonic() - started < load_settings(pool.env).host_silence + 5
            assert router.sh(lease, "echo exec still works") == "exec still works\n"
        finally:
            pool.start_worker("eval")
        assert router.evaluate(lease).status_code == 200
    finally:
        router.close(lease)


def test_a_second_beat_stands_by_until_the_first_is_gone(pool):
    """Beat runs once per deployment: a second one waits on a Redis lock and takes over only
    when the first dies (so the reaper's schedule never runs twice)."""
    lock_owner = lambda: store(pool).beat_lock().owner().split(":")  # noqa: E731
    first = pool.procs["beat"].pid
    assert wait_for(lambda: lock_owner()[1:2] == [str(first)], 30)
    second = pool._spawn("beat2", [sys.executable, "-m", "tasks.worker", "beat"]).pid
    assert wait_for(lambda: "standing by" in pool.logs("beat2"), 60), pool.logs("beat2")
    assert lock_owner()[1] == str(first)
    pool.kill("beat")
    assert wait_for(lambda: lock_owner()[1:2] == [str(second)], 30), lock_owner()
    pool.procs["beat"] = pool.procs.pop("beat2")  # the stack stops it as its beat


# Both daemons run on this machine's one kernel: each NATs what leaves its bridges from their
# subnets (`-s <subnet> ! -o <its bridge> -j MASQUERADE`), so with one subnet on both, the first
# daemon's rule catches traffic inside the second's bridge, whose replies then take the first
# bridge's route. Separate hosts share no rules and no routes; for the test, traffic within the
# fixture's subnet is not NATed (inserted once both networks exist: Docker inserts its rules first).
SHARED_KERNEL_RULE = ["POSTROUTING", "-s", "10.231.0.0/24", "-d", "10.231.0.0/24", "-j", "RETURN"]


def test_a_task_pinning_a_subnet_runs_once_per_host(pool, router, daemons):
    """compose-fixed-subnet allows one live run per host (its subnet and static addresses): two
    runs at once go to both hosts, each its whole episode on its own daemon; a third is a 429
    that says why."""
    task = "compose-fixed-subnet"
    serving = lambda: all(pool.get("/status").json()["pool"]["hosts"][h]["state"] == "serving" for h in daemons)  # noqa: E731
    assert wait_for(serving, 60), pool.get("/status").json()["pool"]["hosts"]
    leases = [router.allocate(task) for _ in daemons]
    nat_rule = False
    try:
        assert {host_of(pool, lease) for lease in leases} == set(daemons)
        reply = pool.post("/allocate", {"task_key": task})
        assert reply.status_code == 429 and "fixed subnet 10.231.0.0/24" in reply.json()["error"], reply.text

        def started(lease: str) -> None:
            reply = router.reset(lease, task)
            assert reply.status_code == 200, reply.text
            for daemon_host, client in daemons.items():
                found = run_labels(client, lease, pool)
                assert len(found) == (3 if daemon_host == host_of(pool, lease) else 0), (lease, daemon_host, found)

        def solved(lease: str) -> float:
            router.solve(lease, task)
            reply = router.evaluate(lease)
            assert reply.status_code == 200, reply.text
            return reply.json()["score"]

        with ThreadPoolExecutor(len(leases)) as both:
            list(both.map(started, leases))
            nat_rule = subprocess.run(["iptables", "-t", "nat", "-I", *SHARED_KERNEL_RULE], check=True) is not None
            assert list(both.map(solved, leases)) == [1.0] * len(leases)
    finally:
        for lease in leases:
            router.close(lease)
        if nat_rule:
            subprocess.run(["iptables", "-t", "nat", "-D", *SHARED_KERNEL_RULE], check=True)
    assert wait_for(lambda: all(not leftovers(client, host, pool) for host, client in daemons.items()), 90)
