"""Lost work: worker processes killed with -9 in the middle of a job, on a stack of our own.

Each case checks that the client is answered soon (the job is retried or fails WORKER_LOST),
that no lock or half-made environment outlives the dead process, and that the run goes on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from devstack import FIXTURES, ROOT, Stack
from poolcore import processes
from poolcore.config import load_settings
from poolcore.queues import make_celery, queue_name
from poolcore.state import LOCK_TTL, OwnedLock, Store
from tests.conftest import Router, stop_checking_leaks, wait_for
from tests.test_metrics import scrape, value

# A process that takes a lock and then sleeps until it is killed.
HOLDER = """
import sys, time, redis
from poolcore.state import OwnedLock
lock = OwnedLock(redis.Redis(port=int(sys.argv[1])), sys.argv[2], ttl=float(sys.argv[3]))
assert lock.acquire()
print("held", flush=True)
time.sleep(600)
"""
BUILD_SLEEP = 20  # the RUN sleep of tests/fixtures/tasks/slow-build
SLACK = 30  # on top of what the work itself takes: a loaded machine, queue hops, scans


# ---- owners of processes and locks (Redis only) ----------------------------------------------
@pytest.mark.unit
def test_a_killed_process_is_known_dead_and_a_live_one_is_not():
    proc = subprocess.Popen(["sleep", "60"])
    facts = {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time(), "pidns": processes.pid_namespace()}
    assert not processes.known_dead(facts)
    assert not processes.known_dead({**facts, "pidns": "elsewhere"})  # another namespace: no verdict
    proc.kill()
    proc.wait()
    assert processes.known_dead(facts)
    me = processes.this_process()
    assert processes.known_dead({**me, "ticks": "1"})  # a reused pid
    assert not processes.known_dead(me)
    # The clock stepped by a second since this process registered: its wall-clock start, which
    # psutil derives from the boot time the kernel gives now, moved; the clock ticks did not.
    assert not processes.known_dead({**me, "started": me["started"] + 1.0})
    # Facts of an older worker (no ticks): wall-clock starts, with slack for such a step.
    old = {"pid": me["pid"], "started": me["started"] + 1.0, "pidns": me["pidns"]}
    assert not processes.known_dead(old)
    assert processes.known_dead({**old, "started": 1.0})


@pytest.mark.unit
def test_a_lock_owner_is_known_by_its_clock_ticks():
    token = processes.owner_token()
    assert ":t" in token and not processes.owner_dead(token)
    host, pid, _, pidns, nonce = token.rsplit(":", 4)
    assert processes.owner_dead(f"{host}:{pid}:t1:{pidns}:{nonce}")  # a reused pid
    me = processes.this_process()  # an owner of an older version: its wall-clock start
    assert not processes.owner_dead(f"{host}:{pid}:{me['started']}:{pidns}:{nonce}")


def hold_lock(redis_server, name: str, ttl: float) -> subprocess.Popen:
    port = redis_server.connection_pool.connection_kwargs["port"]
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(port), name, str(ttl)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.unit
def test_a_lock_lives_while_its_owner_renews_it_and_names_it(redis_server):
    holder = hold_lock(redis_server, "test-lock:renewed", 1.5)
    try:
        time.sleep(4)  # well past the TTL: renewed meanwhile
        lock = OwnedLock(redis_server, "test-lock:renewed", ttl=1.5)
        assert not lock.acquire(wait=1)
        assert lock.owner().split(":")[1] == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.unit
def test_a_dead_owners_lock_is_taken_at_once(redis_server):
    holder = hold_lock(redis_server, "test-lock:dead", 60)
    holder.kill()
    holder.wait()
    lock = OwnedLock(redis_server, "test-lock:dead")
    started = time.monotonic()
    assert lock.acquire(wait=30)
    assert time.monotonic() - started < 5  # not the 60 s TTL: the owner's pid is gone
    lock.release()
    assert not redis_server.exists("test-lock:dead")


@pytest.mark.unit
def test_a_lock_of_an_owner_we_cannot_see_expires_with_its_ttl(redis_server):
    redis_server.set("test-lock:remote", "elsewhere:1:1.0:otherns:abcd", px=1500)  # another machine's owner
    lock = OwnedLock(redis_server, "test-lock:remote")
    assert not lock.acquire()
    assert lock.acquire(wait=10)
    lock.release()


@pytest.mark.unit
def test_a_warm_container_claimed_by_a_lost_start_goes_when_its_run_closes(redis_server):
    state = Store(redis_server)
    state.warm_push("h", "task", {"warm_id": "warm-1"})
    assert state.warm_known("warm-1")
    state.update_run("run-1", state="starting")
    assert state.warm_claim("h", "task", "run-1")["warm_id"] == "warm-1"
    assert state.warm_claim("h", "task", "run-2") is None  # handed to one run alone
    assert state.warm_known("warm-1")  # the start may still hand it to its run
    state.update_run("run-1", state="closed")
    assert not state.warm_known("warm-1")  # closed without naming it: the reconcile sweep removes it


# ---- worker processes killed with -9 --------------------------------------------------------
@pytest.fixture(scope="module")
def lost_stack(base_image, docker_client, tmp_path_factory):
    dataset = tmp_path_factory.mktemp("dataset")
    for task in ("hello-file", "sidecar-kv", "slow-build", "slow-tests"):  # copied again per test
        shutil.copytree(FIXTURES / task, dataset / task)
    # One build process: the prefork child to kill is the only child.
    s = Stack(env={"DATASET_DIR": str(dataset), "BUILD_CONCURRENCY": "1"}).start()
    s.dataset = dataset
    yield s
    stop_checking_leaks(s, docker_client)


@pytest.fixture(scope="module")
def pool(lost_stack) -> Router:
    return Router(lost_stack)


@pytest.fixture
def own_task(lost_stack, docker_client):
    """Copies of fixture tasks under new names: images of their own, that no other test (of
    any helper's stack on this dockerd) builds, caches or removes; removed afterwards."""
    names = []

    def copy(fixture: str) -> str:
        name = f"{fixture}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(lost_stack.dataset / fixture, lost_stack.dataset / name)
        (lost_stack.dataset / name / "nonce").write_text(name)  # slow-build's Dockerfile copies it
        names.append(name)
        return name

    yield copy
    for name in names:  # by tag: a copy's image may be another task's too (same layers)
        for image in docker_client.images.list(name=f"tb__{name}__*"):
            for tag in image.tags:
                if tag.startswith(f"tb__{name}__"):
                    docker_client.images.remove(tag, force=True)


@pytest.fixture
def slow_task(own_task) -> str:
    """A copy of slow-build no other build has cached."""
    return own_task("slow-build")


def store(stack: Stack) -> Store:
    return Store.from_url(stack.env["REDIS_URL"])


def start_job_on(stack: Stack, lease: str, kind: str, timeout: float = 120) -> dict:
    """The run's start job once a worker of `kind` runs it."""

    def running():
        jobs = store(stack).run_jobs(lease)
        job = store(stack).get_job(jobs[-1]) if jobs else None
        if job and job["state"] == "running" and job.get("node", "").startswith(kind + "-"):
            return job
        return None

    job = wait_for(running, timeout, 0.05)
    assert job, f"no {kind} worker took the start of {lease}"
    return job


def kill_build_child(stack: Stack) -> None:
    children = psutil.Process(stack.procs["build"].pid).children()
    assert len(children) == 1, children
    children[0].kill()


def kill_while(stack: Stack, worker: str, request, under_way) -> tuple:
    """Send a blocking request, kill the worker once under_way() holds; (reply, seconds from
    the kill to the reply)."""
    with ThreadPoolExecutor(1) as executor:
        pending = executor.submit(request)
        assert wait_for(under_way, 60, 0.1), f"the request never got under way on the {worker} worker"
        time.sleep(1)
        stack.kill(worker)
        killed = time.monotonic()
        reply = pending.result(timeout=120)
    return reply, time.monotonic() - killed


def reset_in_background(pool: Router, lease: str, task: str):
    executor = ThreadPoolExecutor(1)
    future = executor.submit(pool.reset, lease, task)
    executor.shutdown(wait=False)
    return future


def test_build_child_killed_mid_build_is_retried(lost_stack, pool, slow_task):
    lease = pool.allocate(slow_task)
    pending = reset_in_background(pool, lease, slow_task)
    job = start_job_on(lost_stack, lease, "build")
    time.sleep(3)  # inside the RUN sleep
    kill_build_child(lost_stack)
    killed = time.monotonic()

    reply = pending.result(timeout=600)
    took = time.monotonic() - killed
    print(f"answered {took:.1f} s after the kill")
    job = store(lost_stack).get_job(job["job_id"])
    assert reply.status_code == 200, reply.text
    assert int(job["attempts"]) == 2 and job["retry_code"] == "WORKER_LOST", job
    # The retried build waited for the dead child's lock at most LOCK_TTL, then built anew.
    assert took < LOCK_TTL + BUILD_SLEEP + SLACK, took
    assert pool.sh(lease, "cat /nonce") == slow_task
    pool.close(lease)


def test_a_build_lost_twice_fails_with_worker_lost(lost_stack, pool, slow_task):
    lease = pool.allocate(slow_task)
    pending = reset_in_background(pool, lease, slow_task)
    job_id = start_job_on(lost_stack, lease, "build")["job_id"]
    time.sleep(3)
    kill_build_child(lost_stack)

    def retry_running():
        job = store(lost_stack).get_job(job_id)
        return job.get("retry_with") and json.loads(job["retry_with"])["options"]["retries"] == 1

    assert wait_for(retry_running, 60, 0.1), store(lost_stack).get_job(job_id)
    time.sleep(3)
    kill_build_child(lost_stack)
    killed = time.monotonic()

    reply = pending.result(timeout=300)
    assert time.monotonic() - killed < 20
    assert reply.status_code == 500, reply.text
    job = store(lost_stack).get_job(job_id)
    assert job["code"] == "WORKER_LOST" and int(job["attempts"]) == 2, job
    assert store(lost_stack).get_run(lease)["state"] == "failed"
    pool.close(lease)


def test_build_worker_killed_mid_build_is_retried_after_restart(lost_stack, pool, slow_task):
    lease = pool.allocate(slow_task)
    pending = reset_in_background(pool, lease, slow_task)
    job = start_job_on(lost_stack, lease, "build")
    time.sleep(3)
    lost_stack.kill("build")
    killed = time.monotonic()
    locks = store(lost_stack).held_locks()
    assert locks and all(0 < left <= LOCK_TTL for left in locks.values()), "the dead build's lock outlives it"
    lost_stack.start_worker("build")

    reply = pending.result(timeout=600)
    took = time.monotonic() - killed
    print(f"answered {took:.1f} s after the kill")
    assert reply.status_code == 200, reply.text
    job = store(lost_stack).get_job(job["job_id"])
    assert int(job["attempts"]) == 2 and job["retry_code"] == "WORKER_LOST", job
    assert took < LOCK_TTL + BUILD_SLEEP + SLACK, took
    assert value(scrape(lost_stack), "termpool_job_retries_total", task="pool.ensure_image", reason="WORKER_LOST") >= 1
    pool.close(lease)


def test_exec_worker_killed_during_a_tool_call(lost_stack, pool, own_task):
    task = own_task("hello-file")
    lease = pool.allocate(task)
    assert pool.reset(lease, task).status_code == 200
    pool.sh(lease, "echo before > /tmp/kept")
    call = {"name": "shell_exec", "arguments": {"id": "x", "command": "sleep 30", "block": True, "timeout": 60}}
    reply, answered = kill_while(
        lost_stack,
        "exec",
        lambda: lost_stack.post("/exec_tool", {"lease_id": lease, "tool_call": call}),
        lambda: store(lost_stack).shown_run(lease)["state"] == "busy",
    )
    assert reply.status_code == 500, reply.text
    assert reply.json().get("code", "WORKER_LOST") == "WORKER_LOST", reply.text
    assert answered < 20, answered
    job = store(lost_stack).get_job(store(lost_stack).run_jobs(lease)[-1])
    assert job["kind"] == "tool_call" and job["code"] == "WORKER_LOST", job
    assert store(lost_stack).get_run(lease)["state"] == "ready"

    lost_stack.start_worker("exec")
    assert pool.sh(lease, "cat /tmp/kept") == "before\n"
    pool.close(lease)


def test_exec_worker_killed_during_a_command_kills_the_command(lost_stack, pool, own_task, docker_client):
    from tests.test_commands import live_processes

    task = own_task("hello-file")
    lease = pool.allocate(task)
    try:
        assert pool.reset(lease, task).status_code == 200
        container = docker_client.containers.get(store(lost_stack).get_run(lease)["env"]["client"])
        reply = lost_stack.post(f"/v1/runs/{lease}/commands", {"command": "sleep 1005 & setsid sleep 1005 & wait"})
        job_id = reply.json()["job_id"]
        started = wait_for(lambda: len(live_processes(container, "sleep 1005")) == 3, 30)  # bash and its two
        assert started, (store(lost_stack).get_job(job_id), live_processes(container, "sleep"))
        lost_stack.kill("exec")
        job = wait_for(lambda: (j := store(lost_stack).get_job(job_id))["state"] == "failed" and j, 60)
        assert job and job["code"] == "WORKER_LOST", store(lost_stack).get_job(job_id)
        assert wait_for(lambda: live_processes(container, "sleep 1005") == [], 20)
    finally:
        if "exec" not in lost_stack.procs:  # killed above
            lost_stack.start_worker("exec")
        pool.close(lease)


def test_eval_worker_killed_while_tests_run(lost_stack, pool, own_task):
    task = own_task("slow-tests")
    lease = pool.allocate(task)
    assert pool.reset(lease, task).status_code == 200
    reply, answered = kill_while(
        lost_stack,
        "eval",
        lambda: pool.evaluate(lease),
        lambda: store(lost_stack).get_run(lease)["state"] == "evaluating",
    )
    assert reply.status_code == 500 and answered < 20, (reply.text, answered)
    job = store(lost_stack).get_job(store(lost_stack).run_jobs(lease)[-1])
    # Its tests had started: not run again (they may have changed the container).
    assert job["kind"] == "evaluation" and job["code"] == "WORKER_LOST" and job.get("attempts", 1) == 1, job
    assert store(lost_stack).get_run(lease)["state"] == "ready"
    lost_stack.start_worker("eval")
    assert pool.sh(lease, "echo alive") == "alive\n"
    pool.close(lease)


def test_exec_worker_killed_during_an_episode(lost_stack, docker_client, own_task):
    task = own_task("hello-file")
    call = {"name": "shell_exec", "arguments": {"id": "a", "command": "sleep 30", "block": True, "timeout": 60}}
    reply = lost_stack.post(
        "/v1/runs",
        {
            "task_meta": {"task_name": task},
            "request_id": uuid.uuid4().hex,
            "script": [call, call],
            "evaluate": True,
            "close": True,
        },
    )
    assert reply.status_code == 202, reply.text
    run_id, jobs = reply.json()["run_id"], reply.json()["jobs"]
    first, second = jobs["tool_calls"]
    assert wait_for(lambda: store(lost_stack).job_state(first) == "running", 120, 0.1)
    time.sleep(1)
    lost_stack.kill("exec")
    try:
        close = lost_stack.get(f"/v1/jobs/{jobs['close']}?wait=60").json()["job"]
        assert close["state"] == "succeeded", close
        assert store(lost_stack).get_job(first)["code"] == "WORKER_LOST"
        assert store(lost_stack).job_state(second) == store(lost_stack).job_state(jobs["evaluation"]) == "failed"
        assert store(lost_stack).get_run(run_id)["state"] == "closed"
        assert not docker_client.containers.list(all=True, filters={"label": f"termpool.run={run_id}"})
    finally:
        lost_stack.start_worker("exec")


def test_lifecycle_worker_killed_during_a_reset(lost_stack, pool, docker_client, own_task):
    task = own_task("sidecar-kv")
    warmup = pool.allocate(task)  # builds the images: the next start is compose up alone
    assert pool.reset(warmup, task).status_code == 200
    pool.close(warmup)

    lease = pool.allocate(task)
    pending = reset_in_background(pool, lease, task)
    job = start_job_on(lost_stack, lease, "lifecycle")
    time.sleep(1)  # compose up is under way: it waits for the sidecar's health check
    lost_stack.kill("lifecycle")
    killed = time.monotonic()
    lost_stack.start_worker("lifecycle")

    reply = pending.result(timeout=300)
    job = store(lost_stack).get_job(job["job_id"])
    if reply.status_code == 200:
        assert int(job["attempts"]) == 2 and job["retry_code"] == "WORKER_LOST", job
        containers = pool.run_containers(docker_client, lease)
        assert len(containers) == 2 and all(c.status == "running" for c in containers), containers
        assert pool.sh(lease, "echo alive") == "alive\n"
    else:
        assert job["code"] == "WORKER_LOST" and time.monotonic() - killed < 20, (reply.text, job)
    pool.close(lease)
    assert wait_for(lambda: not pool.run_containers(docker_client, lease), 60)


def test_a_close_whose_message_died_with_its_worker_is_sent_again_at_its_restart(lost_stack, pool, docker_client):
    """The teardown worker took a close off its queue and was killed before listing the job
    (acks on receipt): the message is gone and the job queued. Done here by purging the queue
    while the worker is down. Its successor sends the close again as it starts, long before
    the reaper would (twice the close timeout)."""
    lease = pool.allocate("hello-file")
    assert pool.reset(lease, "hello-file").status_code == 200
    assert pool.run_containers(docker_client, lease)
    lost_stack.kill("teardown")
    pool.close(lease)
    app = make_celery(load_settings(lost_stack.env))
    with app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge(queue_name(lost_stack.host_id, "teardown")) >= 1
    assert store(lost_stack).get_run(lease)["state"] == "closing"
    lost_stack.start_worker("teardown")
    assert wait_for(lambda: store(lost_stack).get_run(lease)["state"] == "closed", 30)
    assert wait_for(lambda: not pool.run_containers(docker_client, lease), 30)
