"""POST /v1/tasks: a client sends a task folder as a tar (or gzip'd tar) archive; the pool keeps
it under the digest of its canonical form, which runs then name as task_meta.task_path
(docs/http-api.md, "Uploaded tasks"; poolcore/uploaded_tasks.py).

  201  stored now; 200  the same content was held already (stored once, its lifetime restarted).
  400  TASK_ARCHIVE_INVALID: unreadable, unsafe, or not a task; 413  TASK_ARCHIVE_TOO_LARGE;
  429  TENANT_QUOTA_EXCEEDED: the tenant's max_upload_bytes (docs/tenants.md).
  Nothing is stored unless the whole archive is taken.
"""

from __future__ import annotations

import json

from flask import Blueprint, request
from werkzeug.exceptions import RequestEntityTooLarge

from app import error_codes, tenancy
from app.http import engine, fail_on, ok, operation
from app.task_upload_models import TaskUploaded
from poolcore import uploaded_tasks
from poolcore.state import QuotaRefused
from poolcore.task_archive import ArchiveInvalid, ArchiveTooLarge

bp = Blueprint("tasks", __name__, url_prefix="/v1")
fail = fail_on(error_codes.runs_status)


@bp.post("/tasks")
@operation(
    "Upload a task folder: the body is a tar or tar.gz archive of its contents (at the archive's top level).",
    {
        201: ("Stored; task_path names it in task_meta", TaskUploaded),
        200: ("This content was stored already; its lifetime starts again", TaskUploaded),
        400: "Unreadable or unsafe archive, or not a task (code TASK_ARCHIVE_INVALID); nothing stored",
        413: "More than UPLOADED_TASK_MAX_BYTES unpacked or UPLOADED_TASK_MAX_FILES entries "
        "(code TASK_ARCHIVE_TOO_LARGE); nothing stored",
        429: "The tenant's uploaded tasks would pass its max_upload_bytes (code TENANT_QUOTA_EXCEEDED); nothing stored",
    },
    tag="tasks",
    raw_body="A tar archive, plain or gzip'd, of the task folder's contents (docs/task-format.md, Uploaded tasks).",
)
def upload_task():
    cfg = engine().cfg
    limits = cfg.uploaded_task_limits
    request.max_content_length = limits.raw_bytes  # a gzip'd archive is smaller than its tar
    try:
        upload = uploaded_tasks.accept(_body(limits.raw_bytes), limits)
    except ArchiveTooLarge as exc:
        return fail("TASK_ARCHIVE_TOO_LARGE", str(exc))
    except ArchiveInvalid as exc:
        return fail("TASK_ARCHIVE_INVALID", str(exc))
    tenant, blob = tenancy.current(), uploaded_tasks.blob_id(upload.task_path)
    new_to_tenant = False
    if tenant:  # the task is the uploading tenant's, within its quota, before a byte is stored
        try:
            new_to_tenant = engine().store.hold_upload(
                tenant.name, blob, upload.size, tenant.max_upload_bytes, cfg.uploaded_task_ttl
            )
        except QuotaRefused as refused:
            return fail("TENANT_QUOTA_EXCEEDED", _over_storage(upload.size, refused))
    try:
        created = _store(upload, cfg.uploaded_task_ttl) or new_to_tenant  # new to the tenant: created
    except Exception:
        if new_to_tenant:
            engine().store.drop_upload(tenant.name, blob)
        raise
    reply = TaskUploaded(
        task_path=upload.task_path,
        kind=upload.kind,
        size=upload.size,
        created=created,
        expires_in=cfg.uploaded_task_ttl,
    )
    return ok(reply, 201 if created else 200)


def _store(upload: uploaded_tasks.Upload, ttl: float) -> bool:
    """Keep the archive once (True when it was not held) and placement's facts of it."""
    created = engine().store.put_blob_once(uploaded_tasks.blob_id(upload.task_path), upload.archive, ttl)
    if upload.one_per_host:  # placement reads them as it reads a dataset task's (Engine.one_per_host)
        facts = json.dumps(upload.one_per_host).encode()
        engine().store.put_blob(uploaded_tasks.facts_id(upload.task_path), facts, ttl)
    return created


def _over_storage(size: int, refused: QuotaRefused) -> str:
    return (
        f"this tenant's uploaded tasks hold {refused.used} bytes; {size} more would pass its "
        f"max_upload_bytes ({refused.limit}): wait for an upload to expire (UPLOADED_TASK_TTL)"
    )


def _body(limit: int) -> bytes:
    try:
        return request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise ArchiveTooLarge(f"the request body is larger than {limit} bytes") from None
