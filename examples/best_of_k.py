"""Best-of-K from the middle of an episode, with forks (termpool.client, Run.fork).

An episode of examples/tasks/count-errors runs a few steps (the prefix a policy took), forks
at a chosen step into K children that start from the run's files as they are then, tries one
continuation in each, evaluates every child and keeps the best reward. Without forks, each of
the K tries would start a fresh run and replay the prefix.

    PYTHONPATH=. python3 examples/best_of_k.py [http://127.0.0.1:18081] [--fork-at 2]   # from the checkout's root
"""

import argparse

from termpool.client import Pool

TASK = "count-errors"
PREFIX = [  # what the policy did before the branch point, one tool call a step
    "head -n 3 /app/server.log",
    "cp /app/server.log /tmp/server.log",
    "wc -l /tmp/server.log",
]
CONTINUATIONS = [  # K tries from the branch point: a wrong, a half right and a right answer
    ("nothing", "true"),
    ("grep -c ERROR (counts a WARN line too)", "grep -c ERROR /tmp/server.log > /app/errors.txt"),
    ("awk on the level field", "awk '$2 == \"ERROR\"' /tmp/server.log | wc -l > /app/errors.txt"),
]


def best_of_k(pool: Pool, fork_at: int) -> tuple[float, str]:
    """Run the prefix up to step `fork_at`, fork K children there, try one continuation in
    each (after the rest of the prefix), and return the best (reward, continuation)."""
    with pool.start(TASK) as run:
        for command in PREFIX[:fork_at]:
            run.exec(command)
        children = run.fork(len(CONTINUATIONS))
    results = []
    for child, (what, command) in zip(children, CONTINUATIONS):
        with child:  # closed on exit, like any run
            for step in PREFIX[fork_at:]:
                child.exec(step)
            child.exec(command)
            reward = child.evaluate().score
        print(f"child {child.id}: reward {reward:.2f}  {what}", flush=True)
        results.append((reward, what))
    return max(results)


def main() -> None:
    parser = argparse.ArgumentParser(description="Best-of-K from a fork of a live run.")
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:18081")
    parser.add_argument("--fork-at", type=int, default=2, help=f"steps of the prefix before the fork (0-{len(PREFIX)})")
    args = parser.parse_args()
    with Pool(args.url) as pool:
        reward, what = best_of_k(pool, args.fork_at)
    print(f"best of {len(CONTINUATIONS)} from step {args.fork_at}: reward {reward:.2f} ({what})")


if __name__ == "__main__":
    main()
