"""The bodies of the command routes (app/commands_api.py), as pydantic models like app/models.py's.

A command is one `bash -c` in the run's agent container, with its own working directory,
environment, user and time limit: Harbor's `BaseEnvironment.exec`. Everything checkable
without the container is checked here, so a bad request is a 400 before anything is queued;
whether a user name exists only the container can say (the job fails UNKNOWN_USER).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, StrictInt, StrictStr, WithJsonSchema, field_validator

from app.fields import TEXT_PATTERN, JobId, refuse
from app.models import RequestBody
from app.replies import JobState, Reply, ReplyBody

# One argv string may be at most 128 KiB including its NUL (Linux's MAX_ARG_STRLEN): the command
# is one (bash -c COMMAND), and each env entry is one "NAME=VALUE" string.
MAX_ARG_BYTES = (128 << 10) - 1
MAX_ENV_BYTES = 1 << 20  # all entries together: execve's whole budget is about 2 MiB
MAX_ENV_NAME = 256
MAX_CWD_BYTES = 4095  # PATH_MAX less its NUL
MAX_USER_LENGTH = 256
MAX_UID = 2**32 - 2  # (uid_t)-1 means "no change" to the kernel
USER_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$"  # what useradd takes, and digits (a uid)
ENV_NAME_PATTERN = r"^[^=\x00]+$"


def _utf8_size(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise refuse("must not contain a NUL character")
    return value


def _user(value):
    """A name, or a uid as an integer or digits: the string Docker's exec takes."""
    if isinstance(value, float) and value.is_integer():  # JSON Schema's integers include 393.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)) and value is not None:
        raise refuse("must be a user name or a uid (integer)")
    if isinstance(value, int):
        if not 0 <= value <= MAX_UID:
            raise refuse(f"must be a uid from 0 to {MAX_UID}")
        return str(value)
    if value is not None and not re.fullmatch(USER_NAME_PATTERN, value):
        raise refuse("must be a user name (letters, digits, '_', '.', '-') or a uid")
    if value is not None and value.isdigit() and int(value) > MAX_UID:
        raise refuse(f"must be a uid from 0 to {MAX_UID}")
    return value


def _timeout(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse("must be a number of seconds")
    return value


CommandText = Annotated[
    StrictStr,
    Field(
        max_length=MAX_ARG_BYTES,
        pattern=TEXT_PATTERN,
        description=f"Run as `bash -c COMMAND`; at most {MAX_ARG_BYTES} bytes of UTF-8, no NUL.",
    ),
]
Cwd = Annotated[
    StrictStr,
    Field(
        description=f"An absolute path, at most {MAX_CWD_BYTES} bytes; null: the container's own.",
        json_schema_extra={"pattern": r"^/[^\x00]*$"},  # checked by _absolute, whose texts say more
    ),
]
# Names and values are checked by CommandRequest._entries; the schema says the same in one place.
EnvMap = Annotated[
    dict[StrictStr, StrictStr],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"minLength": 1, "maxLength": MAX_ENV_NAME, "pattern": ENV_NAME_PATTERN},
            "additionalProperties": {"type": "string", "pattern": TEXT_PATTERN},
        }
    ),
]
UserName = Annotated[StrictStr, Field(max_length=MAX_USER_LENGTH, pattern=USER_NAME_PATTERN)]
Uid = Annotated[StrictInt, Field(ge=0, le=MAX_UID)]  # in the schema: _user makes it digits
User = Annotated[UserName | Uid | None, BeforeValidator(_user)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Timeout = Annotated[Seconds | None, BeforeValidator(_timeout)]


class CommandRequest(RequestBody):
    command: CommandText
    cwd: Cwd | None = None
    env: EnvMap | None = Field(
        None,
        description=f"Set over the container's environment; each NAME=VALUE at most {MAX_ARG_BYTES} bytes, "
        f"{MAX_ENV_BYTES} bytes in all.",
    )
    user: User = Field(None, description="A user name or a uid (integer or digits); null: the container's default.")
    timeout_sec: Timeout = Field(None, description="Seconds; null or more than COMMAND_MAX_TIMEOUT: that.")

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        if _utf8_size(value) > MAX_ARG_BYTES:
            raise refuse(f"is longer than {MAX_ARG_BYTES} bytes (one argument of execve)")
        return _no_nul(value)

    @field_validator("cwd")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith("/"):
            raise refuse("must be an absolute path")
        if _utf8_size(value) > MAX_CWD_BYTES:
            raise refuse(f"is longer than {MAX_CWD_BYTES} bytes")
        return _no_nul(value)

    @field_validator("env")
    @classmethod
    def _entries(cls, value: dict | None) -> dict | None:
        total = 0
        for name, text in (value or {}).items():
            if not name or "=" in name or "\x00" in name or len(name) > MAX_ENV_NAME:
                raise refuse(f"has a bad name {name[:40]!r}: 1-{MAX_ENV_NAME} characters, no '=' or NUL")
            entry = _utf8_size(name) + 1 + _utf8_size(text)
            if entry > MAX_ARG_BYTES:
                raise refuse(f"{name}: NAME=VALUE is longer than {MAX_ARG_BYTES} bytes")
            _no_nul(text)
            total += entry
        if total > MAX_ENV_BYTES:
            raise refuse(f"is larger than {MAX_ENV_BYTES} bytes in all")
        return value


class CommandResult(ReplyBody):
    """A command job's result (GET /v1/jobs/<id>): a non-zero exit is a result, not a failure."""

    return_code: int = Field(description="The exit status; 124 when timed out, 128+N when killed by signal N.")
    stdout: str = Field(description="UTF-8, undecodable bytes replaced.")
    stderr: str
    stdout_truncated: bool = Field(description="Cut at COMMAND_OUTPUT_LIMIT bytes.")
    stderr_truncated: bool
    timed_out: bool = Field(description="timeout_sec passed: everything the command started was killed.")


class Cancelled(Reply):
    job_id: JobId
    cancelled: Literal[True] = True


class NotCancelled(Reply):
    job_id: JobId
    cancelled: Literal[False] = False
    state: JobState
