"""When each image in the pool's registry was last pushed or pulled (environments/registry.py),
so its reclaim (environments/registry_reclaim.py) deletes only what has gone unused:

  registry:used   zset: "<repository>:<tag>" -> last push or pull (epoch seconds); a tag the
                  reclaim finds with no record gets the time it was first seen
"""

from __future__ import annotations

import redis

from termpool.state import keys


class RegistryUsesState:
    _r: redis.Redis

    def registry_used(self, member: str, at: float) -> None:
        self._r.zadd(keys.REGISTRY_USED, {member: at})

    def registry_first_seen(self, member: str, at: float) -> None:
        """Start the clock of a tag with no record (one already recorded keeps its time)."""
        self._r.zadd(keys.REGISTRY_USED, {member: at}, nx=True)

    def registry_last_used(self, member: str) -> float | None:
        return self._r.zscore(keys.REGISTRY_USED, member)

    def registry_forget(self, members: list[str]) -> None:
        if members:
            self._r.zrem(keys.REGISTRY_USED, *members)
