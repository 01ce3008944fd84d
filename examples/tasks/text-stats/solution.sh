#!/bin/bash
set -e
python3 - <<'PY'
import json
import string

text = open("/app/input.txt").read()
words = text.split()
cleaned = [word.strip(string.punctuation).lower() for word in words]
stats = {"lines": len(text.splitlines()), "words": len(words), "longest_word": max(cleaned, key=len)}
with open("/app/stats.json", "w") as out:
    json.dump(stats, out)
PY
