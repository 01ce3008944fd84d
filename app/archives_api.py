"""Files into and out of a run's container as tar streams (docs/http-api.md, section 2).

  PUT  /v1/runs/<run_id>/archive?path=/abs/dir   tar body -> 202 {job_id}: a put_archive job
       extracts it into the directory (made if missing), merging with what is there.
  POST /v1/runs/<run_id>/archive/export {"path"} -> 202 {job_id}: a get_archive job reads the
       file or directory as a tar; its result is {size, path_type}.
  GET  /v1/jobs/<job_id>/archive                 -> 200 the tar bytes of a succeeded export.

The bytes travel through Redis (the blob keyed by the job id: poolcore/state/blobs.py), since
the hosts share no file system with the facade. An upload is checked whole here before
anything is stored or queued (termpool/tar_rules.py), so a refused one leaves no trace. A run
refuses an archive job as it refuses a tool call (UNKNOWN_RUN, RUN_NOT_READY, RUN_CLOSED,
HOST_LOST, WORKERS_DOWN); the jobs run on the run's host's exec queue.
"""

from __future__ import annotations

from flask import Blueprint, Response, request
from pydantic import TypeAdapter, ValidationError

from app import error_codes
from app.archive_models import ArchiveAccepted, ContainerPath, ExportRequest
from app.fields import explain
from app.http import BadRequest, engine, fail_on, ok, operation
from app.runs_api import UNKNOWN_RUN, WRONG_STATE, answer_run_errors
from poolcore import dispatch
from termpool import tar_rules

bp = Blueprint("archives", __name__, url_prefix="/v1")
answer_run_errors(bp)
fail = fail_on(error_codes.runs_status)

PATH = TypeAdapter(ContainerPath)
TAR = "application/x-tar"
ACCEPTED = ("Accepted; poll the job", ArchiveAccepted)


def _query_path() -> str:
    """The ?path= of an upload: the directory to extract into."""
    if "path" not in request.args:
        raise BadRequest("the query parameter path is required: the directory to extract into")
    try:
        return PATH.validate_python(request.args["path"])
    except ValidationError as exc:
        raise BadRequest(explain(exc, "path")) from None


def _archive_body() -> bytes:
    """The raw request body, at most ARCHIVE_MAX_BYTES (else werkzeug raises the 413)."""
    request.max_content_length = engine().cfg.archive_max_bytes
    return request.get_data(cache=False)


def _queue(run_id: str, kind: str, task: str, blob: bytes | None = None, **kwargs) -> str:
    """Record and send an archive job (`kwargs` are its task's) on a started run's host; an
    upload's bytes are stored first, under the job's id, and taken back if it cannot be sent."""
    run = engine().live_run(run_id)  # UnknownLease, RunClosed, NotReady, HostUnavailable
    engine().require_serving(run, kind)
    store = engine().store
    job_id = dispatch.new_job_id()
    if blob is not None:
        store.put_blob(job_id, blob, engine().cfg.archive_ttl)
    try:
        host, priority = run["host"], run.get("priority")
        return dispatch.send_job(engine().celery, store, job_id, kind, task, run_id, host, priority=priority, **kwargs)
    except BaseException:
        store.drop_blob(job_id)
        raise


@bp.put("/runs/<run_id>/archive")
@operation(
    "Extract a tar archive (the body, application/x-tar) into a directory of the run's container.",
    {
        202: ACCEPTED,
        400: "Bad path (BAD_REQUEST) or a refused archive (BAD_ARCHIVE)",
        404: UNKNOWN_RUN,
        409: WRONG_STATE,
        413: "The body is larger than ARCHIVE_MAX_BYTES (PAYLOAD_TOO_LARGE)",
        414: (
            "The request line is over gunicorn's 4094 bytes (a path of thousands of characters): gunicorn's own page",
            "text/html",
        ),
    },
    query={"path": ("The directory to extract into; made if missing.", PATH)},
    tag="runs",
)
def put_archive(run_id: str):
    path = _query_path()
    data = _archive_body()
    try:
        tar_rules.check_archive(data)
    except tar_rules.ArchiveRefused as exc:
        return fail("BAD_ARCHIVE", str(exc))
    job_id = _queue(run_id, "put_archive", "pool.put_archive", data, path=path, ttl=engine().cfg.archive_ttl)
    return ok(ArchiveAccepted(job_id=job_id), 202)


@bp.post("/runs/<run_id>/archive/export")
@operation(
    "Read a file or directory of the run's container as a tar archive (fetch it from /v1/jobs/<id>/archive).",
    {202: ACCEPTED, 404: UNKNOWN_RUN, 409: WRONG_STATE},
    ExportRequest,
    tag="runs",
)
def export_archive(run_id: str, body: ExportRequest):
    cfg = engine().cfg
    limits = {"max_bytes": cfg.archive_max_bytes, "ttl": cfg.archive_ttl, "timeout": cfg.archive_read_timeout}
    job_id = _queue(run_id, "get_archive", "pool.get_archive", path=body.path, **limits)
    return ok(ArchiveAccepted(job_id=job_id), 202)


@bp.get("/jobs/<job_id>/archive")
@operation(
    "The tar archive a get_archive job read (application/x-tar), until ARCHIVE_TTL after the job ended.",
    {
        200: ("The archive", bytes),
        404: "Unknown job (UNKNOWN_JOB); not a succeeded export, or its archive expired (ARCHIVE_NOT_FOUND)",
    },
    tag="runs",
)
def read_archive(job_id: str):
    store = engine().store
    job = store.get_job(job_id)
    if job is None:
        return fail("UNKNOWN_JOB", f"unknown job: {job_id}")
    if job.get("kind") != "get_archive" or job.get("state") != "succeeded":
        why = f"a {job.get('kind')} job" if job.get("kind") != "get_archive" else f"{job.get('state')}, not succeeded"
        return fail("ARCHIVE_NOT_FOUND", f"job {job_id} has no archive to read: it is {why}")
    data = store.get_blob(job_id)
    if data is None:
        ttl = engine().cfg.archive_ttl
        return fail(
            "ARCHIVE_NOT_FOUND", f"the archive of job {job_id} has expired (ARCHIVE_TTL: {ttl} s after the job)"
        )
    return Response(data, mimetype=TAR)
