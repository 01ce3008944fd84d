"""When each image in the pool's registry was last pushed or pulled (environments/registry.py),
so its reclaim (environments/registry_reclaim.py) deletes only what has gone unused:

  registry:used              zset: "<repository>:<tag>" -> last push or pull (epoch seconds); a
                             tag the reclaim finds with no record gets the time it was first seen
  registry-pending:<h>       hash: local image -> its name in the registry, for the pushes host h
                             could not make (the registry down or refusing); its reconcile retries

and, in host:<h>:info, `registry` (reachable / unreachable / off) and `registry_detail` (why),
as host h's workers last found it.
"""

from __future__ import annotations

import time

import redis

from poolcore.state import keys


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

    # ---- a host's side ------------------------------------------------------------------------
    def note_registry(self, host: str, state: str, detail: str = "") -> None:
        """How host found the pool's registry: reachable, unreachable (detail: why) or off."""
        fields = {"registry": state, "registry_detail": detail, "registry_at": repr(time.time())}
        self._r.hset(keys.host_info_key(host), mapping=fields)

    def push_pending(self, host: str, images: dict[str, str]) -> None:
        if images:
            self._r.hset(keys.registry_pending_key(host), mapping=images)

    def pending_pushes(self, host: str) -> dict[str, str]:
        return self._r.hgetall(keys.registry_pending_key(host))

    def push_done(self, host: str, local: str) -> None:
        self._r.hdel(keys.registry_pending_key(host), local)
