"""Job priority classes (docs/tenants.md): which of the jobs waiting in a host's queue is taken
first. A run's class is recorded with it (Store.place, copied to fork children) and every job
of the run is sent with it (poolcore/dispatch.py); kombu's Redis transport keeps one list per
priority step of each queue and its workers' BRPOP names the lists highest class first.

Pure data and one rule, no dependencies: the tenants file, the facade and the workers share it.
"""

from __future__ import annotations

CLASSES = ("eval", "train")  # highest first
DEFAULT = "train"  # a run of the operator's, or of a record made before priorities
# kombu's Redis priorities: a lower number is taken first; each level is one of STEPS.
LEVELS = {"eval": 0, "train": 5}
STEPS = sorted(LEVELS.values())


class PriorityNotAllowed(ValueError):
    """A run asked for a class above its tenant's."""


def level(name: str | None) -> int:
    """The message priority of a class (an unknown or missing one: DEFAULT's)."""
    return LEVELS.get(name or DEFAULT, LEVELS[DEFAULT])


def resolve(asked: str | None, ceiling: str | None) -> str:
    """A run's class: `asked` (None: not asked) under `ceiling`, its tenant's class (None: the
    operator, whose runs may take any class and default to DEFAULT). A tenant's runs default
    to its class and may ask for a lower one, never a higher: PriorityNotAllowed."""
    if asked is None:
        return ceiling or DEFAULT
    if ceiling is not None and CLASSES.index(asked) < CLASSES.index(ceiling):
        raise PriorityNotAllowed(
            f"priority {asked!r} is above this tenant's class {ceiling!r}; ask for {ceiling!r} or a lower one "
            f"(highest first: {', '.join(CLASSES)})"
        )
    return asked


# kombu's Redis transport keeps a queue's messages of each priority step in a list of its own:
# the queue's name for the first step, then the name, SEP and the step (its `sep` option, which
# poolcore/queues.py sets to this). A queue's depth is the sum of their lengths.
SEP = "\x06\x16"


def queue_lists(queue: str) -> list[str]:
    """The Redis lists holding `queue`'s waiting messages, highest class first."""
    return [queue if step == STEPS[0] else f"{queue}{SEP}{step}" for step in STEPS]
