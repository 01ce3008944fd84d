"""Run one function in several threads at once (the tests' and the benchmark's races)."""

from __future__ import annotations

import threading


def at_once(callers: int, fn) -> list[Exception]:
    """Call `fn` from `callers` threads started together; the exceptions they raised."""
    errors: list[Exception] = []

    def call():
        try:
            fn()
        except Exception as exc:  # collected: the other callers go on
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
