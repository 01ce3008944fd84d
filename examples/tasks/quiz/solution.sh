#!/bin/bash
# Drive `quiz` the way an agent would: read each question, then answer it.
set -e
python3 - <<'PY'
import re
import subprocess

quiz = subprocess.Popen(["quiz"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=0)
text = ""
while True:
    char = quiz.stdout.read(1)
    if not char:
        break
    text += char
    if text.endswith("answer> "):
        a, op, b = re.findall(r"what is (\d+) ([-+*]) (\d+)\?", text)[-1]
        quiz.stdin.write(f"{eval(f'{a} {op} {b}')}\n")
        quiz.stdin.flush()
        text = ""
print(text.strip())
raise SystemExit(quiz.wait())
PY
