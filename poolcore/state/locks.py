"""Locks: OwnedLock, and the build and beat locks (build-lock:<h>:<image>, beat-lock) made of it."""

from __future__ import annotations

import logging
import math
import threading
import time

import redis

from poolcore import processes
from poolcore.state import keys

log = logging.getLogger(__name__)

LOCK_TTL = 12.0  # a lock outlives its owner by at most this long: the owner renews it meanwhile
LOCK_POLL = 0.2
_BREAK_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class OwnedLock:
    """A Redis lock that lives only while its owner keeps renewing it.

    The value names the owner process (processes.owner_token); a daemon thread of the owner
    renews the TTL every third of it. A waiter takes the lock of an owner that died within
    LOCK_TTL seconds, and at once when it can tell from the pid that the owner is gone.
    """

    def __init__(self, client: redis.Redis, name: str, ttl: float = LOCK_TTL):
        self.name = name
        self._client = client
        self._ttl = ttl
        # Not thread-local: the renewing thread must see the owner's token.
        self._lock = client.lock(name, timeout=ttl, thread_local=False)
        self._break = client.register_script(_BREAK_LOCK)
        self._stop = threading.Event()

    def acquire(self, wait: float = 0) -> bool:
        """Take the lock, waiting up to `wait` seconds for it (0: do not wait)."""
        token = processes.owner_token()
        deadline = time.monotonic() + wait
        while not self._lock.acquire(blocking=False, token=token):
            holder = self.owner()
            if holder and processes.owner_dead(holder):
                log.warning("lock %s: its owner %s is gone; taking it over", self.name, holder)
                self._break(keys=[self.name], args=[holder])
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(LOCK_POLL, max(deadline - time.monotonic(), 0)))
        self._token = token  # what the renewer takes the lock back with, should it expire
        self._stop = threading.Event()  # one per holding: a late renewer of an earlier one stops
        threading.Thread(target=self._renew, args=(self._stop,), daemon=True, name=f"renew {self.name}").start()
        return True

    def owner(self) -> str:
        value = self._client.get(self.name)
        return value.decode() if isinstance(value, bytes) else (value or "")

    def release(self) -> None:
        self._stop.set()
        try:
            self._lock.release()
        except redis.exceptions.LockError:
            pass  # expired meanwhile (the owner stalled past its TTL): nothing to release

    def __enter__(self) -> OwnedLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(self._ttl / 3):
            try:
                self._lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                if stop.is_set():
                    return
                # The TTL ran out before a renewal (this process stalled): take it back if nobody
                # else has, so the owner does not go on without its lock; otherwise say so.
                if self._lock.acquire(blocking=False, token=self._token):
                    log.warning("lock %s expired before a renewal; taken back", self.name)
                    continue
                log.warning("lock %s was lost (its TTL ran out before a renewal)", self.name)
                return
            except redis.exceptions.RedisError:
                log.warning("renewing lock %s failed; retrying", self.name, exc_info=True)


class LocksState:
    """Store's locks."""

    _r: redis.Redis  # Store.__init__ sets it

    def build_lock(self, host: str, image: str) -> OwnedLock:
        """One build of an image per host at a time."""
        return OwnedLock(self._r, keys.build_lock_key(host, image))

    def pool_build_lock(self, digest: str) -> OwnedLock:
        """One build of a task environment (by content digest) in the whole pool at a time: the
        other hosts wait for it, then pull what it pushed to the pool's registry."""
        return OwnedLock(self._r, keys.pool_build_lock_key(digest))

    def beat_lock(self) -> OwnedLock:
        """One beat scheduler per deployment (one Redis): a second one stands by until it is free."""
        return OwnedLock(self._r, keys.BEAT_LOCK)

    def held_locks(self) -> dict[str, float]:
        """Every build lock held now -> seconds until it expires unless renewed
        (inf for one without a TTL, which no OwnedLock leaves)."""
        names = [name for pattern in keys.LOCK_PATTERNS for name in self._r.scan_iter(match=pattern, count=1000)]
        pipe = self._r.pipeline(transaction=False)
        for name in names:
            pipe.pttl(name)
        left = {}
        for name, ms in zip(names, pipe.execute()):
            if ms != -2:  # -2: released since the scan
                left[name] = math.inf if ms == -1 else ms / 1000
        return left

    def builds_in_progress(self) -> list[dict]:
        """The builds under way now, one per build lock held: a host's build of an image
        ({"host", "image"}) or a pool-wide one of a task environment ({"host": "", "image": digest})."""
        host_prefix, pool_prefix = keys.build_lock_key("", ""), keys.pool_build_lock_key("")
        builds = []
        for name in sorted(self.held_locks()):
            if name.startswith(pool_prefix):
                builds.append({"host": "", "image": name.removeprefix(pool_prefix)})
            else:
                host, _, image = name.removeprefix(host_prefix[:-1]).partition(":")
                builds.append({"host": host, "image": image})
        return builds
