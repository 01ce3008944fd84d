"""Closes sent again: a closing run whose close job was lost gets a new one, and a run whose
close job still waits in its queue or runs gets none (each would be one more teardown message
for every run in a long queue: a mass close of hundreds of runs waits longer than the reaper's
period, and it used to send another close per waiting run each round).

A close job is in hand while it has not ended and either runs (a process holds it; if that
process dies, tasks/lost_jobs.py recovers it from its list) or is queued while its message can
still be waiting: its host's teardown queue holds messages, or it was queued less than the
grace ago (its message may be on its way: a job is recorded before it is sent). Workers take a
message only when a slot is free and begin its job at once (no prefetch: poolcore/queues.py),
so a close still queued past the grace while its queue is empty had its message lost (a
process killed between taking it and beginning, a Redis that lost its queue): it is sent again.
While the queue holds messages a lost close waits for it to drain; closes are idempotent, so
one sent again needlessly finds nothing left to remove."""

from __future__ import annotations

import time

from poolcore.dispatch import enqueue_close
from poolcore.queues import queue_name
from tasks.runtime import store


def in_hand(closes: list[dict], queue_waiting: bool, queued_since: float) -> bool:
    """Whether a run's unended close jobs ({"state", "queued_at"}) will tear it down without
    another: one runs, or one is queued while the queue holds messages or since queued_since."""
    return any(close["state"] == "running" or queue_waiting or close["queued_at"] >= queued_since for close in closes)


def unattended(host: str, run_ids: list[str], grace: float) -> list[str]:
    """Of these closing runs of `host`, those with no close job in hand."""
    if not run_ids:
        return []
    queue = queue_name(host, "teardown")
    waiting = store().queue_depths([queue])[queue] > 0
    closes = store().unended_closes(run_ids)
    since = time.time() - grace
    return [run_id for run_id in run_ids if not in_hand(closes[run_id], waiting, since)]


def resend(app, host: str, run_ids: list[str], grace: float) -> list[str]:
    """Send a close for each of these closing runs with none in hand; the runs sent for."""
    sent = unattended(host, run_ids, grace)
    for run_id in sent:
        enqueue_close(app, store(), run_id, host)
    return sent
