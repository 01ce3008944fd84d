"""environments/kept_result.py without Docker: a command's result read from its trailer, or
from its folder once the engine is back when its stream ended early; a refusal is not waited on."""

from __future__ import annotations

import pytest
import requests
from docker.errors import APIError
from docker.models.containers import ExecResult

from environments import kept_result

pytestmark = pytest.mark.unit


class Container:
    """Answers exec_run from a script of replies (an ExecResult, or an exception to raise)."""

    def __init__(self, *replies):
        self.replies, self.calls = list(replies), []

    def exec_run(self, argv, **kw):
        self.calls.append(argv)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def test_the_trailer_gives_the_status_and_is_not_in_the_output():
    class Echo(Container):
        def exec_run(self, argv, **kw):
            self.calls.append(argv)
            if argv[0] == "rm":
                return ExecResult(0, b"")
            return ExecResult(0, b"3 passed\n" + b"\n" + argv[5].encode() + b" 124\n")

    container = Echo()
    result = kept_result.run(container, ["run-tests"], user="root", environment=None, limit=5)
    assert result == ExecResult(124, b"3 passed\n")
    assert container.calls[-1][:2] == ["rm", "-rf"]  # its folder


def test_a_plain_exec_keeps_its_own_status():
    """No folder could be made (read-only /tmp): the command ran as a plain exec."""
    result = kept_result.run(Container(ExecResult(2, b"out")), ["x"], user="", environment=None, limit=5)
    assert result == ExecResult(2, b"out")


def test_a_stream_cut_by_the_engine_is_read_back_once_it_is_back(monkeypatch):
    monkeypatch.setattr(kept_result, "POLL_SECONDS", 0.01)
    away = requests.exceptions.ConnectionError("('Connection aborted.', FileNotFoundError(2, 'No such file'))")
    container = Container(
        away,  # the stream ended with the old daemon
        away,  # still away
        ExecResult(4, b""),  # back; the tests still run (no status yet)
        ExecResult(0, b"0\n1 passed\n"),
        ExecResult(0, b""),  # the folder removed
    )
    assert kept_result.run(container, ["t"], user="root", environment=None, limit=5) == ExecResult(0, b"1 passed\n")
    assert container.calls[-1][:2] == ["rm", "-rf"] and container.calls[-1][2].startswith(kept_result.FOLDER_PREFIX)


def test_the_new_daemon_not_knowing_the_exec_is_the_engine_away(monkeypatch):
    monkeypatch.setattr(kept_result, "POLL_SECONDS", 0.01)
    forgotten = APIError("404", explanation="No such exec instance: 1234")
    forgotten.response = type("R", (), {"status_code": 404})()
    container = Container(forgotten, ExecResult(0, b"1\nfailed\n"), ExecResult(0, b""))
    assert kept_result.run(container, ["t"], user="root", environment=None, limit=5) == ExecResult(1, b"failed\n")


def test_a_stopped_container_is_not_waited_on(monkeypatch):
    monkeypatch.setattr(kept_result, "POLL_SECONDS", 0.01)
    away = requests.exceptions.ConnectionError("away")
    stopped = APIError("409", explanation="Container abc is not running")
    stopped.response = type("R", (), {"status_code": 409})()
    with pytest.raises(APIError):
        kept_result.run(Container(away, stopped), ["t"], user="root", environment=None, limit=60)


def test_a_result_never_written_fails_at_the_limit(monkeypatch):
    monkeypatch.setattr(kept_result, "POLL_SECONDS", 0.01)
    container = Container(ExecResult(None, b"partial"), *[ExecResult(4, b"")] * 1000)
    with pytest.raises(kept_result.ResultLost):
        kept_result.run(container, ["t"], user="root", environment=None, limit=0.1)
    container = Container(ExecResult(None, b"partial"), ExecResult(kept_result.GONE, b""))
    with pytest.raises(kept_result.ResultLost, match="gone"):
        kept_result.run(container, ["t"], user="root", environment=None, limit=60)


def test_a_command_that_never_reached_the_engine_starts_once_it_is_back(monkeypatch):
    monkeypatch.setattr(kept_result, "POLL_SECONDS", 0.01)
    refused = requests.exceptions.ConnectionError(ConnectionRefusedError(111, "Connection refused"))

    class Back(Container):
        def exec_run(self, argv, **kw):
            if argv[:2] == ["bash", "-c"] and argv[2] == kept_result.WRAPPER and len(self.calls) > 2:
                self.calls.append(argv)
                return ExecResult(0, b"ran\n\n" + argv[5].encode() + b" 0\n")
            return super().exec_run(argv, **kw)

    container = Back(refused, refused, ExecResult(kept_result.GONE, b""), ExecResult(0, b""))
    assert kept_result.run(container, ["t"], user="root", environment=None, limit=5) == ExecResult(0, b"ran\n")
    wrapped = [argv for argv in container.calls if argv[2:3] == [kept_result.WRAPPER]]
    assert len(wrapped) == 2  # refused once, started once it was back


def test_a_result_in_hand_is_kept_when_its_folder_cannot_be_removed():
    class Echo(Container):
        def exec_run(self, argv, **kw):
            if argv[0] == "rm":
                raise requests.exceptions.ConnectionError("away again")
            return ExecResult(0, b"ok\n\n" + argv[5].encode() + b" 0\n")

    assert kept_result.run(Echo(), ["t"], user="root", environment=None, limit=5) == ExecResult(0, b"ok\n")
