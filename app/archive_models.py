"""Request and reply bodies of the archive routes (app/archives_api.py): file transfer into and
out of a run's container as tar streams."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, StrictStr

from app.fields import CONTROL_CHARACTERS, PRINTABLE_PATTERN, JobId, refuse
from app.replies import Reply

MAX_CONTAINER_PATH = 4096  # characters of a path in the container (Linux's PATH_MAX)
# What /openapi.json says (the fuzzer reads it): absolute, no control characters. The validator
# below checks the leading / itself, for a readable refusal.
ABSOLUTE_PATTERN = f"^/[^{CONTROL_CHARACTERS}]*$"


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise refuse("must be an absolute path (start with /)")
    return value


ContainerPath = Annotated[
    StrictStr,
    Field(
        min_length=1,
        max_length=MAX_CONTAINER_PATH,
        pattern=PRINTABLE_PATTERN,
        description=f"An absolute path in the run's container: no control characters, at most "
        f"{MAX_CONTAINER_PATH} characters.",
        json_schema_extra={"pattern": ABSOLUTE_PATTERN},
    ),
    AfterValidator(_absolute),
]


class ExportRequest(BaseModel):
    path: ContainerPath = Field(description="The file or directory to read, as a tar archive.")


class ArchiveAccepted(Reply):
    job_id: JobId = Field(description="The archive job; poll it with GET /v1/jobs/<job_id>.")


class ExportResult(BaseModel):
    """A get_archive job's result (docs/http-api.md)."""

    size: int = Field(description="Bytes of the tar archive.")
    path_type: Literal["file", "directory"] = Field(description="What the path is (a symlink counts as a file).")
