"""What a pool-wide prebuild reports (cli/prebuild.py, tasks/prebuild_jobs.py).

  prebuild:<batch>   hash, PREBUILD_TTL: "<host> <task path>" -> JSON result of that host's
                     prebuild of the task (status built / pulled / present / failed, seconds,
                     image, error)

The command sends one job per task (and host) to the hosts' build queues and reads this hash
until every job has answered: Celery keeps no results here (task_ignore_result).
"""

from __future__ import annotations

import json

import redis

from poolcore.state import keys


class BuildsState:
    _r: redis.Redis

    def prebuild_done(self, batch: str, host: str, task_path: str, result: dict) -> None:
        pipe = self._r.pipeline()
        pipe.hset(keys.prebuild_key(batch), f"{host} {task_path}", json.dumps(result))
        pipe.expire(keys.prebuild_key(batch), keys.PREBUILD_TTL)
        pipe.execute()

    def prebuild_results(self, batch: str) -> dict[tuple[str, str], dict]:
        """(host, task path) -> result, for every job of the batch that has answered."""
        raw = self._r.hgetall(keys.prebuild_key(batch))
        return {tuple(field.split(" ", 1)): json.loads(value) for field, value in raw.items()}
