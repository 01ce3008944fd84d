"""The run folders a host keeps after its runs closed: host:<h>:run-folders, so the reconcile
removes each RUN_FOLDER_TTL after its run's teardown without walking the output root."""

from __future__ import annotations

import time

import redis

from poolcore.state import keys


class FoldersState:
    """Store's index of closed runs' folders."""

    _r: redis.Redis  # Store.__init__ sets it

    def note_run_folder(self, host: str, path: str, at: float | None = None) -> None:
        """The folder of a run torn down on `host` (at `at`, default now); noting it again
        moves its time (a teardown sent twice)."""
        self._r.zadd(keys.run_folders_key(host), {path: time.time() if at is None else at})

    def run_folders_before(self, host: str, cutoff: float, limit: int) -> list[str]:
        """At most `limit` folders of runs torn down before `cutoff`, oldest first."""
        return self._r.zrangebyscore(keys.run_folders_key(host), "-inf", cutoff, start=0, num=limit)

    def forget_run_folders(self, host: str, paths: list[str]) -> None:
        if paths:
            self._r.zrem(keys.run_folders_key(host), *paths)
