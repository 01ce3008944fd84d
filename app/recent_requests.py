"""The dashboard's record of answered requests (poolcore/state/recent.py), written in batches.

Written per request, the record was a Redis round trip on every call's path (a third of an
allocate's time in the facade). Here a request only adds to this process's counts; a
background thread writes them once a second in one pipelined round trip, so the dashboard's
last hour lags by at most that second. Counts not yet written when the process dies are lost
(at most a second's worth of a chart, never a run's state); counts Redis refuses are dropped,
as /metrics reports Redis away meanwhile.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable

from poolcore.state import UNAVAILABLE, Store
from poolcore.state.recent import error_field, minute, request_field

log = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0


class RecentRequests:
    """This process's counts of answered requests since the last write, and their writer."""

    def __init__(self, store: Callable[[], Store], interval: float = FLUSH_SECONDS):
        self.store, self.interval = store, interval  # store: made on first use (the scrape's)
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (minute, "tenant|endpoint|class") -> n
        self.errors: Counter = Counter()  # (minute, "tenant|code") -> n
        self.writer_pid = 0  # the process whose writer thread runs (gunicorn forks workers)
        self.stopped = threading.Event()

    def add(self, tenant: str, endpoint: str, seconds: float, code: str = "") -> None:
        now = minute()
        with self.lock:
            self.requests[(now, request_field(tenant, endpoint, seconds))] += 1
            if code:
                self.errors[(now, error_field(tenant, code))] += 1
        if self.writer_pid != os.getpid():
            self.start_writer()

    def start_writer(self) -> None:
        with self.lock:
            if self.writer_pid == os.getpid():
                return
            self.writer_pid = os.getpid()
        threading.Thread(target=self.write_every_interval, name="recent-requests", daemon=True).start()
        atexit.register(self.flush)

    def write_every_interval(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.flush()
            except Exception:  # a surprise must not end the writer: later counts would pile up
                log.exception("writing the dashboard's request counts failed")

    def flush(self) -> None:
        """Write the counts gathered so far (nothing when there are none)."""
        with self.lock:
            requests, errors = self.requests, self.errors
            self.requests, self.errors = Counter(), Counter()
        if not requests and not errors:
            return
        try:
            self.store().record_requests(requests, errors)
        except UNAVAILABLE:
            pass

    def stop(self) -> None:
        """Write what is left and end the writer (an app stopped inside a longer process)."""
        self.stopped.set()
        self.flush()
