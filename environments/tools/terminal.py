"""Turning a session's raw output bytes into observation text."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[()*+][0-~]|[@-_=>78])")
_ESC_PREFIX = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*|[()*+])?\Z")


def clean(data: bytes, pty: bool = False) -> str:
    """Decode as UTF-8 dropping invalid bytes and remove ANSI escape sequences. A pty turns
    every newline into CRLF; that CR is the terminal's, not the program's, so it goes too."""
    text = _ANSI.sub("", data.decode("utf-8", errors="ignore"))
    return text.replace("\r\n", "\n") if pty else text


def complete_len(data: bytes) -> int:
    """How much of the output of a still-running process can be shown now: a multi-byte
    character, an escape sequence or a CRLF cut at the end waits for its remaining bytes (the
    stored offset is not advanced past it)."""
    cut = len(data)
    for i in range(cut - 1, max(cut - 4, -1), -1):
        byte = data[i]
        if byte & 0xC0 == 0x80:  # continuation byte: look further back for the lead byte
            continue
        need = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
        if cut - i < need:
            cut = i
        break
    esc = data.rfind(b"\x1b", max(0, cut - 256), cut)
    if esc >= 0 and _ESC_PREFIX.match(data, esc, cut):
        cut = esc
    if cut and data[cut - 1] == 0x0D:
        cut -= 1
    return cut
