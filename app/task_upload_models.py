"""The reply of POST /v1/tasks (app/tasks_api.py), apart from app/models.py: its body is an
archive, not JSON, so only the reply is a model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.replies import Reply


class TaskUploaded(Reply):
    task_path: str = Field(
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="What a run names as task_meta.task_path: the digest of the folder's canonical form.",
    )
    kind: Literal["terminal-bench", "harbor", "harbor-environment"] = Field(
        description="The folder's format; a harbor-environment has no tests (its evaluation: TASK_HAS_NO_TESTS)."
    )
    size: int = Field(description="Bytes of the folder's files, unpacked.")
    created: bool = Field(description="False when the pool held this content already (its lifetime starts again).")
    expires_in: float = Field(description="Seconds it is kept unless a run or an upload names it again.")
