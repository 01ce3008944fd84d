"""Redis high availability: termpool on a Sentinel deployment (a primary, a replica, three
sentinels; devstack/sentinel.py) loses its primary to kill -9 under load. The sentinels promote
the replica, episodes go on, and a call caught by the failover fails with a retryable code at
most; termpool.client's retries and a router's resend of a retryable step carry the episodes
through. Every process is real; the primary is killed by pid."""

from __future__ import annotations

import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from devstack import ROOT, Stack
from devstack.sentinel import SentinelGroup
from poolcore.config import load_settings
from poolcore.state import RecordLost, Store, connection
from termpool.client import Pool, TermpoolError
from tests.conftest import stop_checking_leaks

TASK = "hello-file"
EPISODES, CONCURRENCY = 12, 4
KILL_AFTER = 4.0  # seconds into the episodes: every worker of the four is mid-episode
STEP_TRIES = 8  # a router's resends of a step answered with a retryable failure


@pytest.mark.unit
def test_sentinel_settings_reach_the_broker_and_the_store():
    cfg = load_settings(
        {
            "REDIS_SENTINELS": "10.0.0.1:26379, 10.0.0.2,[fd00::3]:26380",
            "REDIS_SENTINEL_MASTER": "pool-a",
            "REDIS_SENTINEL_PASSWORD": "s3",
            "REDIS_PASSWORD": "p/w",
            "REDIS_DB": "2",
        }
    )
    assert cfg.redis_sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("fd00::3", 26380))
    assert connection.broker_url(cfg) == (
        "sentinel://:p%2Fw@10.0.0.1:26379/2;sentinel://:p%2Fw@10.0.0.2:26379/2;sentinel://:p%2Fw@[fd00::3]:26380/2"
    )
    assert connection.broker_transport_options(cfg) == {"master_name": "pool-a", "sentinel_kwargs": {"password": "s3"}}
    # kombu reads the same sentinels, database and password back from that URL
    from kombu import Connection

    parsed = Connection(connection.broker_url(cfg), transport_options=connection.broker_transport_options(cfg))
    assert parsed.transport_cls == "sentinel" and parsed.alt[2].startswith("sentinel://:p%2Fw@[fd00::3]:26380")
    master = connection.client(cfg).connection_pool
    assert master.service_name == "pool-a"
    assert master.connection_kwargs["password"] == "p/w" and master.connection_kwargs["db"] == 2
    with pytest.raises(ValueError, match="REDIS_SENTINELS"):
        load_settings({"REDIS_SENTINELS": "fd00::3:26379"})
    plain = load_settings({"REDIS_URL": "redis://h:1/0"})
    assert connection.broker_url(plain) == "redis://h:1/0" and connection.broker_transport_options(plain) == {}


@pytest.mark.unit
def test_every_redis_client_is_made_in_one_place():
    """A Redis client made anywhere else would keep talking to one address through a failover."""
    made_here = {ROOT / "poolcore" / "config.py", ROOT / "poolcore" / "state" / "connection.py"}
    elsewhere = re.compile(r"redis_url|\bRedis\(|Redis\.from_url|Sentinel\(|Store\.from_url\(|Celery\(")
    found = [
        (str(path.relative_to(ROOT)), line.strip())
        for folder in ("app", "tasks", "termpool", "poolcore", "cli", "environments")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path not in made_here
        for line in path.read_text().splitlines()
        if elsewhere.search(line)
    ]
    celery = 'app = Celery("termpool", broker=connection.broker_url(cfg), backend=None, include=include or [])'
    assert found == [("poolcore/queues.py", celery)], found


@pytest.mark.unit
def test_lua_scripts_work_on_the_promoted_replica(tmp_path):
    """The promoted replica never saw the scripts loaded on the old primary (SCRIPT LOAD is not
    replicated): redis-py's Script meets NOSCRIPT, loads it there and sends it again."""
    group = SentinelGroup(tmp_path).start()
    try:
        store = Store.connect(load_settings(group.settings_env()), timeout=5)
        store._r.hset("t:run", "state", "ready")
        assert store._transition(keys=["t:run"], args=["busy", "ready"]) == 1
        assert store._r.wait(1, 5000) == 1  # the replica has the write (replication is asynchronous)
        old = group.kill_primary()
        group.wait_failover(old)
        new = group.node(group.primary_port())
        assert new.script_exists(store._transition.sha) == [False]
        assert _eventually(lambda: store._transition(keys=["t:run"], args=["ready", "busy"])) == 1
        assert new.hget("t:run", "state") == "ready"
    finally:
        group.stop()


@pytest.mark.unit
def test_a_job_record_lost_under_a_waiting_call_is_retryable(redis_server):
    """The window a failover loses: the job record the facade wrote is not on the new primary.
    The blocking call answers as Redis away does (503 REDIS_UNAVAILABLE), not 500."""
    from app.engine import Engine
    from app.errors import BACKEND_DOWN

    port = redis_server.connection_pool.connection_kwargs["port"]
    cfg = load_settings({"REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    engine = Engine(cfg, Store(redis_server), celery=None)
    try:
        with pytest.raises(RecordLost, match="vanished") as lost:
            engine.wait("job-written-to-the-old-primary", 1)
    finally:
        engine.stop()  # its liveness watch, before the session's redis-server goes
    assert isinstance(lost.value, BACKEND_DOWN)


def _eventually(call, seconds: float = 30):
    """call() once the client has found the new primary (a connection error before that)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ha_stack(base_image, docker_client, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sentinel-stack")
    s = Stack(workdir=workdir, redis_group=SentinelGroup(workdir)).start()
    yield s
    stop_checking_leaks(s, docker_client)


class Failures:
    """Every failed request of the episodes: (step, code, retryable), thread-safe."""

    def __init__(self):
        self.seen: list[tuple[str, str, bool]] = []
        self.lock = threading.Lock()

    def step(self, name: str, call):
        """A step sent again, as a router does, while it fails with a retryable code."""
        for attempt in range(STEP_TRIES):
            try:
                return call()
            except TermpoolError as error:
                with self.lock:
                    self.seen.append((name, error.code, bool(error.retryable)))
                if not error.retryable or attempt == STEP_TRIES - 1:
                    raise
                time.sleep(1)


def run_episode(pool: Pool, failures: Failures) -> tuple[float, float]:
    """One whole episode through the runs API; its start and end (monotonic)."""
    began = time.monotonic()
    run = failures.step("start", lambda: pool.start(TASK, request_id=uuid.uuid4().hex))
    try:
        assert "hi" in failures.step("exec", lambda: run.exec("echo hi"))
        assert "slept" in failures.step("exec", lambda: run.exec("sleep 2; echo slept"))
        failures.step("write", lambda: run.write_file("/app/hello.txt", "Hello, world!\n"))
        assert failures.step("evaluate", run.evaluate).score == 1.0
    finally:
        failures.step("close", run.close)
    return began, time.monotonic()


def test_episodes_go_on_through_a_failover(ha_stack):
    stack, group = ha_stack, ha_stack.redis_group
    pool = Pool(stack.url, timeout=30, job_timeout=120)  # termpool.client's own retries: on
    run_episode(pool, Failures())  # the image is built before the clock starts
    failures = Failures()
    revived: list[str] = []
    done = threading.Event()

    def supervise():
        """What serve.sh's supervisord does: start again a worker that exited."""
        while not done.wait(1):
            revived.extend(stack.revive())

    threading.Thread(target=supervise, daemon=True).start()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as executor:
            begin = time.monotonic()
            episodes = [executor.submit(run_episode, pool, failures) for _ in range(EPISODES)]
            time.sleep(KILL_AFTER)
            killed_at = time.monotonic()
            old = group.kill_primary()
            failover_s = group.wait_failover(old)
            spans = [episode.result(timeout=300) for episode in episodes]
    finally:
        done.set()
    took = time.monotonic() - begin
    codes = sorted({code for _, code, _ in failures.seen})
    print(
        f"\nepisodes (start after the kill, s: duration, s) {[(round(a - killed_at, 1), round(b - a, 1)) for a, b in spans]}"
    )
    print(
        f"\nfailover {failover_s:.1f} s; {EPISODES} episodes in {took:.1f} s; failures {failures.seen}; revived {revived}"
    )

    assert group.primary_port() != old
    assert sum(1 for start, end in spans if start < killed_at < end) >= CONCURRENCY - 1, "the kill hit no episode"
    assert all(retryable for _, _, retryable in failures.seen), failures.seen
    # Redis away for a moment (503); or a step whose end was written to the old primary and
    # never reached the replica, which the episode's error path finds running (WORKER_LOST).
    assert set(codes) <= {"REDIS_UNAVAILABLE", "WORKER_LOST"}, codes
    # Every episode ended whole on the new primary, and the pool serves a new one.
    assert run_episode(pool, Failures())[1] > killed_at
    assert stack.redis.info("replication")["role"] == "master"
