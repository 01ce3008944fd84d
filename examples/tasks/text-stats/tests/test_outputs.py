"""Four tests, so an answer that gets some keys right scores 0.25 per passing test."""

import json
import string
from pathlib import Path

STATS = Path("/app/stats.json")
TEXT = Path("/app/input.txt").read_text()


def stats() -> dict:
    return json.loads(STATS.read_text())


def test_stats_is_a_json_object():
    assert isinstance(stats(), dict)


def test_lines():
    assert stats().get("lines") == len(TEXT.splitlines())


def test_words():
    assert stats().get("words") == len(TEXT.split())


def test_longest_word():
    words = [word.strip(string.punctuation).lower() for word in TEXT.split()]
    assert stats().get("longest_word") == max(words, key=len)
