"""What /metrics reads: failure and retry counters (count:failures, count:retries), whether a
monitor listens for task events (monitor), and the depth of Celery's queues."""

from __future__ import annotations

import math

import redis

from poolcore import priorities
from poolcore.state import keys


class CountersState:
    """Store's counters."""

    _r: redis.Redis  # Store.__init__ sets it

    # ---- failure and retry counters (read by /metrics) -----------------------------------
    def failure_counts(self) -> dict[str, int]:
        return {code: int(n) for code, n in self._r.hgetall(keys.FAILURE_COUNTS).items()}

    def retry_counts(self) -> dict[tuple[str, str], int]:
        """(task name, reason code) -> retries."""
        return {tuple(key.split("|", 1)): int(n) for key, n in self._r.hgetall(keys.RETRY_COUNTS).items() if "|" in key}

    # ---- a monitor listening for task events (tasks/flower.py) ----------------------------
    def announce_monitor(self, ttl: float) -> None:
        """A monitor listens for task events for the next `ttl` seconds."""
        self._r.set(keys.MONITOR, "1", ex=max(1, math.ceil(ttl)))

    def monitor_listening(self) -> bool:
        return bool(self._r.exists(keys.MONITOR))

    # ---- Celery's queues (kombu's lists in the same Redis) ---------------------------------
    def queue_depths(self, queues: list[str]) -> dict[str, int]:
        """Messages waiting in each queue (package docstring: one list per priority step), one
        round trip."""
        lists = {queue: priorities.queue_lists(queue) for queue in queues}
        pipe = self._r.pipeline(transaction=False)
        for names in lists.values():
            for name in names:
                pipe.llen(name)
        lengths = iter(pipe.execute())
        return {queue: sum(next(lengths) for _ in names) for queue, names in lists.items()}
