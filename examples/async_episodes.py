"""Eight episodes at once from one asyncio loop, with termpool.client.AsyncPool.

Each episode starts a task of examples/tasks, lets a "policy" act (here a fixed shell
command standing in for a model's tool calls), runs the task's tests for the reward and
closes the run. An infrastructure failure (retryable) is run again; a task failure counts.

    PYTHONPATH=. python3 examples/async_episodes.py [http://127.0.0.1:18081]    # from the checkout's root
    python3 examples/async_episodes.py [http://127.0.0.1:18081]    # once the client is installed (pip install .)
"""

import asyncio
import sys
import time

from termpool.client import AsyncPool, TermpoolError

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18081"
STATS = (
    "python3 -c \"import json; t = open('/app/input.txt').read(); "
    "json.dump({'lines': len(t.splitlines()), 'words': len(t.split())}, open('/app/stats.json', 'w'))\""
)
AWK = "awk '$2 == \"ERROR\"' /app/server.log | wc -l > /app/errors.txt"
EPISODES = [  # (task, what the policy does, its command): right, half right and wrong answers
    ("count-errors", "awk on the level field", AWK),
    ("count-errors", "grep -c ERROR (counts a WARN line too)", "grep -c ERROR /app/server.log > /app/errors.txt"),
    ("count-errors", "nothing", "true"),
    ("count-errors", "awk on the level field", AWK),
    ("text-stats", "lines and words, no longest_word", STATS),
    ("text-stats", "an empty JSON object", "echo '{}' > /app/stats.json"),
    ("inventory-total", "a guess, without asking the sidecar", "echo 0 > /app/total.txt"),
    ("quiz", "a forged result file", "echo 42 > /app/quiz.txt"),
]


async def episode(pool: AsyncPool, task: str, command: str, attempts: int = 3) -> float:
    for attempt in range(1, attempts + 1):
        try:
            async with await pool.start(task) as run:  # closed on exit
                await run.exec(command)
                return (await run.evaluate()).score
        except TermpoolError as exc:
            if not exc.retryable or attempt == attempts:
                raise
            print(f"{task}: {exc.code}, running the episode again", flush=True)


async def main() -> None:
    started = time.monotonic()
    async with AsyncPool(URL) as pool:
        rewards = await asyncio.gather(*(episode(pool, task, command) for task, _, command in EPISODES))
    for (task, what, _), reward in zip(EPISODES, rewards):
        print(f"{task:16} reward {reward:.2f}  {what}")
    print(f"{len(EPISODES)} episodes in {time.monotonic() - started:.1f} s")


asyncio.run(main())
