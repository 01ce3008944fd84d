"""How much output the tools keep and show, and the note where they cut it."""

from __future__ import annotations

from dataclasses import dataclass

from environments.tools.texts import OMITTED
from poolcore.config import settings

NOTE_RESERVE = 512  # longer than the omitted-output note plus any status text after the output


@dataclass(frozen=True)
class OutputLimits:
    """How much output a session keeps on disk (bytes; the oldest is dropped beyond it) and
    how long one observation may be (characters; the newest part is kept)."""

    session_bytes: int
    observation_chars: int

    @classmethod
    def from_settings(cls) -> OutputLimits:
        cfg = settings()
        return cls(cfg.session_output_limit, cfg.observation_limit)

    @property
    def read_bytes(self) -> int:
        """The most output bytes one observation asks the helper for: with its note and status
        text the observation then stays within observation_chars (a byte is at most a character)."""
        return max(self.observation_chars - NOTE_RESERVE, 1)


def cap_text(text: str, limit: int) -> str:
    """text, or its newest part behind an OMITTED note, in at most `limit` characters."""
    if limit <= 0 or len(text) <= limit:
        return text
    keep = max(limit - NOTE_RESERVE, 0)
    return OMITTED.format(count=len(text) - keep, unit="characters") + text[len(text) - keep :]


def with_omitted(text: str, dropped: int) -> str:
    """text behind the note that the helper dropped `dropped` older bytes (limits)."""
    return OMITTED.format(count=dropped, unit="bytes") + text if dropped > 0 else text
