"""When a host last used each task image, for its image disk budget (environments/image_budget.py):
image-used:<h> scores each image by the time of its last use on host h (a run or a warm spare
started from it, a build of it), and image-tasks:<h> names the task path each image was last
used for, so the sweep that removes an image can forget that the task's image is ready there."""

from __future__ import annotations

import time

import redis

from poolcore.state import keys


class ImageUsesState:
    """Store's record of each host's task image uses."""

    _r: redis.Redis  # Store.__init__ sets it

    def note_image_use(self, host: str, image: str, task_path: str, at: float | None = None) -> None:
        """`image` (the name a build of it took its lock under) was used on `host` for
        `task_path` at `at` (default now); a later use moves its time."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(keys.image_used_key(host), {image: time.time() if at is None else at})
        if task_path:
            pipe.hset(keys.image_tasks_key(host), image, task_path)
        pipe.execute()

    def image_uses(self, host: str) -> dict[str, float]:
        """Every image host has noted a use of, with the time of its last use."""
        return dict(self._r.zrange(keys.image_used_key(host), 0, -1, withscores=True))

    def image_tasks(self, host: str) -> dict[str, str]:
        """Every image host has noted a use of -> the task path of its last use."""
        return self._r.hgetall(keys.image_tasks_key(host))

    def image_task(self, host: str, image: str) -> str | None:
        """The task path `image` was last used for on host (None: no use noted)."""
        return self._r.hget(keys.image_tasks_key(host), image)

    def forget_image_uses(self, host: str, images: list[str]) -> None:
        """Images no longer on host: their uses go with them."""
        if images:
            pipe = self._r.pipeline(transaction=False)
            pipe.zrem(keys.image_used_key(host), *images)
            pipe.hdel(keys.image_tasks_key(host), *images)
            pipe.execute()
