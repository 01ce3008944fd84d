"""The Idempotency-Key request header of the requests that queue a job on a run (the runs API's
tool calls, commands, evaluations and forks; the pool API's /exec_tool): a request sent again
with the key of an earlier one on the same run, within IDEMPOTENCY_TTL (a client's retry after
a lost reply or a retryable failure), answers the job of the first (the pool API waits for it)
and queues nothing, so the work runs once. Without the header every request queues a job of
its own, as before."""

from __future__ import annotations

import time
from typing import Annotated

from flask import request
from pydantic import StringConstraints, TypeAdapter, ValidationError

from app.fields import MAX_ID_LENGTH
from app.http import BadRequest, engine
from poolcore import dispatch

HEADER = "Idempotency-Key"
FIRST_REQUEST_WAIT = 5.0  # seconds a retry waits for the first request to record its job
# Printable ASCII, no space at either end (HTTP strips those from a header's value).
KEY = TypeAdapter(Annotated[str, StringConstraints(max_length=MAX_ID_LENGTH, pattern=r"^[!-~]([ -~]*[!-~])?$")])
# What /openapi.json says of the header (app/http.py Operation.headers).
DOCUMENTED = {
    HEADER: (
        "Optional. Sent again with the same key on the same run within 300 s, the request queues nothing "
        "and answers the first request's job.",
        KEY,
    )
}


def job_once(run_id: str, queue) -> str:
    """`queue(job_id)` queues the job under that id and returns it; with the request's key, only
    the first request of that key on the run does, and the others answer its job."""
    key = request_key()
    job_id = dispatch.new_job_id()
    if key is None:
        return queue(job_id)
    store = engine().store
    deadline = time.monotonic() + FIRST_REQUEST_WAIT
    while (held := store.claim_request(run_id, key, job_id)) != job_id:
        # The first request holds the key: its job, once recorded; if it is refused meanwhile
        # it lets the key go, and this one queues the job itself.
        if store.get_job(held) is not None or time.monotonic() > deadline:
            return held
        time.sleep(0.05)
    try:
        return queue(job_id)
    except BaseException:
        store.drop_request(run_id, key, job_id)
        raise


def request_key() -> str | None:
    """The request's key, if given: printable ASCII, at most MAX_ID_LENGTH characters."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    try:
        return KEY.validate_python(key)
    except ValidationError:
        raise BadRequest(f"{HEADER} must be 1 to {MAX_ID_LENGTH} printable ASCII characters") from None
