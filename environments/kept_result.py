"""A command whose result outlives a restart of the Docker engine (the tests of an evaluation).

With dockerd's live-restore a run's container, and the processes in it, keep running while the
daemon restarts, but an exec's attached stream (its output and exit status) ends with the old
daemon. So the command leaves its output and exit status in a folder of the container as
well, and prints them after a trailer line only it knows; when the stream ends without that
trailer, the result is read from the folder once the engine answers again, within the
command's own time limit. The folder goes once its result has been read (by another exec:
the command cannot tell whether its stream still had a reader).
"""

from __future__ import annotations

import contextlib
import secrets
import time

import docker.errors
import requests.exceptions
from docker.models.containers import ExecResult

from environments.docker_client import never_reached_engine
from poolcore.failures import DockerError

FOLDER_PREFIX = "/tmp/.termpool-result-"
SLACK_SECONDS = 30.0  # past the command's own time limit: the engine's return, the read back
POLL_SECONDS = 1.0
MAX_POLL_SECONDS = 5.0  # a long test run read back after a silent stream timed out
GONE = 3  # the read script's exit status when the folder is not there

# $1 the folder, $2 the trailer token, then the command. The output goes to a file first: a
# process writing to an exec stream that lost its reader would block or die. Where no folder
# can be made (a read-only /tmp) the command runs as a plain exec.
WRAPPER = r"""d=$1; token=$2; shift 2
mkdir -m 700 "$d" 2>/dev/null || exec "$@"
"$@" >"$d/out" 2>&1
code=$?
echo "$code" >"$d/status.new" && mv "$d/status.new" "$d/status"
cat "$d/out" && printf '\n%s %s\n' "$token" "$code"
"""
READ = f'test -d "$1" || exit {GONE}; cat "$1/status" 2>/dev/null || exit 4; cat "$1/out"'


def _engine_away(exc: Exception) -> bool:
    """The engine could not answer (stopped, starting, or a silent stream's read timeout), or
    a new daemon knows nothing of the old one's exec; not an answer of its own (an error, a
    container that no longer runs), which is the caller's failure."""
    if isinstance(exc, docker.errors.APIError):
        return exc.status_code == 404 and "exec" in str(exc.explanation).lower()
    return isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout))


class ResultLost(DockerError):
    """The command's stream ended early and its folder could not be read in time."""


def run(container, argv: list[str], *, user: str, environment: dict | None, limit: float) -> ExecResult:
    """`container.exec_run(argv)` (stdout and stderr merged) whose result survives an engine
    restart; `limit`: how long the command may still run once its stream has ended (its own
    time limit, the engine's return included). A command whose exec never reached the engine
    (it was away) is started once it is back, once."""
    for attempt in (1, 2):
        token = secrets.token_hex(8)
        folder = FOLDER_PREFIX + token
        wrapped = ["bash", "-c", WRAPPER, "termpool-result", folder, token, *argv]
        try:
            result = container.exec_run(wrapped, user=user, environment=environment, demux=False)
        except Exception as exc:
            if not _engine_away(exc):
                raise
            unstarted = never_reached_engine(exc) and attempt == 1
            found = _read_back(container, folder, limit, exc, started=not unstarted)
            if found is None:
                continue  # the engine is back and nothing of it ran: start it now
            return found
        output = result.output or b""
        body, sep, trailer = output.rpartition(b"\n" + token.encode() + b" ")
        if sep and trailer.strip().lstrip(b"-").isdigit():
            # Removed from here, not by the command: it cannot tell whether its reader was there.
            _remove(container, folder)
            return ExecResult(int(trailer.strip()), body)
        if result.exit_code is not None:  # it ended as a plain exec (no folder), or never started
            return result
        return _read_back(container, folder, limit, None)  # the stream ended while it ran
    raise AssertionError("unreachable")


def _read_back(container, folder: str, limit: float, cause: Exception | None, started: bool = True):
    """The result from its folder, polling while the engine is away or the command runs; None
    once the engine answers when the command never `started` (its folder is not there)."""
    deadline = time.monotonic() + limit
    wait = POLL_SECONDS
    while True:
        found = _read(container, folder, cause)
        if found is not None and found.exit_code == 0:
            status, _, out = (found.output or b"").partition(b"\n")
            _remove(container, folder)
            return ExecResult(int(status.strip()), out)
        if found is not None and found.exit_code == GONE:
            if not started:
                return None
            raise ResultLost("the command's stream ended early and its result was gone") from cause
        if time.monotonic() >= deadline:
            if cause is not None:
                raise cause
            raise ResultLost(f"the command's stream ended early and no result came within {limit:g} s")
        time.sleep(wait)
        wait = min(wait * 1.5, MAX_POLL_SECONDS)


def _read(container, folder: str, cause: Exception | None) -> ExecResult | None:
    """The read script's result; None while the engine is away."""
    try:
        return container.exec_run(["bash", "-c", READ, "termpool-read", folder], user="root")
    except Exception as exc:
        if _engine_away(exc):
            return None
        raise exc from cause  # a refusal: its container stopped (the caller's failure says so)


def _remove(container, folder: str) -> None:
    """Best effort: the result is in hand; a folder left (the engine went away just now) goes
    with the run's container."""
    with contextlib.suppress(Exception):
        container.exec_run(["rm", "-rf", folder], user="root")
