"""Lost work: locks and processes that outlive no dead owner."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.stack import ROOT
from termpool import processes
from termpool.state import OwnedLock

# A process that takes a lock and then sleeps until it is killed.
HOLDER = """
import sys, time, redis
from termpool.state import OwnedLock
lock = OwnedLock(redis.Redis(port=int(sys.argv[1])), sys.argv[2], ttl=float(sys.argv[3]))
assert lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


# ---- owners of processes and locks (Redis only) ----------------------------------------------
def test_a_killed_process_is_known_dead_and_a_live_one_is_not():
    proc = subprocess.Popen(["sleep", "60"])
    facts = {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time(), "pidns": processes.pid_namespace()}
    assert not processes.known_dead(facts)
    assert not processes.known_dead({**facts, "pidns": "elsewhere"})  # another namespace: no verdict
    proc.kill()
    proc.wait()
    assert processes.known_dead(facts)
    assert processes.known_dead({**processes.this_process(), "started": 1.0})  # a reused pid
    assert not processes.known_dead(processes.this_process())


def hold_lock(redis_server, name: str, ttl: float) -> subprocess.Popen:
    port = redis_server.connection_pool.connection_kwargs["port"]
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), name, str(ttl)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_lives_while_its_owner_renews_it_and_names_it(redis_server):
    holder = hold_lock(redis_server, "tp:test-lock:renewed", 1.5)
    try:
        time.sleep(4)  # well past the TTL: renewed meanwhile
        lock = OwnedLock(redis_server, "tp:test-lock:renewed", ttl=1.5)
        assert not lock.acquire(wait=1)
        assert lock.owner().split(":")[1] == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_owners_lock_is_taken_at_once(redis_server):
    holder = hold_lock(redis_server, "tp:test-lock:dead", 60)
    holder.kill()
    holder.wait()
    lock = OwnedLock(redis_server, "tp:test-lock:dead")
    started = time.monotonic()
    assert lock.acquire(wait=30)
    assert time.monotonic() - started < 5  # not the 60 s TTL: the owner's pid is gone
    lock.release()
    assert not redis_server.exists("tp:test-lock:dead")


def test_a_lock_of_an_owner_we_cannot_see_expires_with_its_ttl(redis_server):
    redis_server.set("tp:test-lock:remote", "elsewhere:1:1.0:otherns:abcd", px=1500)  # another machine's owner
    lock = OwnedLock(redis_server, "tp:test-lock:remote")
    assert not lock.acquire()
    assert lock.acquire(wait=10)
    lock.release()
