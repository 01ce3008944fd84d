"""Numbered slots that processes on this machine take side by side (a lock file each, held
with flock from start to stop): a second daemon's addresses, a stack's run-network range.
A process that dies lets its slots go with its open files."""

from __future__ import annotations

import fcntl
import time


def take_slot(lock_path: str, slots: int, wait: float, prefer: int = 0):
    """(slot, open lock file) of the first free slot from `prefer` on (taken without waiting:
    one process may hold several); when all are held, try again until `wait` seconds have
    passed. Closing the file gives the slot back."""
    deadline = time.monotonic() + wait
    while True:
        for slot in [*range(prefer, slots), *range(prefer)]:
            lock = open(lock_path.format(slot=slot), "a")  # noqa: SIM115 (held until the owner's stop)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            return slot, lock
        if time.monotonic() > deadline:
            raise RuntimeError(f"no free slot of {slots} ({lock_path}) in {wait:.0f} s")
        time.sleep(1.0)
