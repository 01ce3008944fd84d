"""Archive jobs: a tar into a run's container (pool.put_archive) and one out of it
(pool.get_archive), on the run's host's exec queue (app/archives_api.py sends them).

The bytes travel through Redis as a blob keyed by the job id (poolcore/state/blobs.py): an
upload's was stored by the facade and is dropped here once used (or on any failure); an
export's is stored here, for GET /v1/jobs/<id>/archive, and expires `ttl` seconds after the job.
"""

from __future__ import annotations

from celery import shared_task

from environments import archives
from poolcore import failures
from poolcore.config import settings
from tasks.job_context import client_container, live_run, recorded_job, started_env
from tasks.runtime import store


def _container(run_id: str):
    """The agent's container of a started run (the one its tool calls use)."""
    return client_container(started_env(live_run(run_id)))


@shared_task(name="pool.put_archive", bind=True)
@recorded_job
def put_archive(self, *, host, run_id, job_id, path, ttl):
    """Extract the uploaded archive into `path` (made if missing), merging with what is there."""
    try:
        container = _container(run_id)
        data = store().get_blob(job_id)
        if data is None:  # waited in the queue past ARCHIVE_TTL: sending it again can work
            raise failures.OperationTimeout(
                f"the uploaded archive expired (ARCHIVE_TTL {ttl} s) before job {job_id} ran"
            )
        archives.extract(container, path, data)
    finally:
        store().drop_blob(job_id)
    return {"path": path, "size": len(data)}


@shared_task(name="pool.get_archive", bind=True)
@recorded_job
def get_archive(self, *, host, run_id, job_id, path, max_bytes, ttl, timeout=None):
    """Read `path` as a tar (at most max_bytes, within `timeout` seconds: a message from a
    facade that sent none gets this host's ARCHIVE_READ_TIMEOUT) and keep it `ttl` seconds
    for its reader."""
    timeout = settings().archive_read_timeout if timeout is None else timeout
    data, path_type = archives.read(_container(run_id), path, max_bytes, timeout)
    store().put_blob(job_id, data, ttl)
    return {"size": len(data), "path_type": path_type}
