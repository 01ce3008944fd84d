import re
from pathlib import Path

RESULT = Path("/app/quiz.txt")
LINE = re.compile(r"^(\d+) ([-+*]) (\d+) = (-?\d+)$")


def test_result_exists():
    assert RESULT.is_file(), f"{RESULT} does not exist: the quiz was not finished"


def test_three_correct_answers():
    lines = RESULT.read_text().splitlines()
    assert len(lines) == 3
    for line in lines:
        a, op, b, answer = LINE.match(line).groups()
        assert eval(f"{a} {op} {b}") == int(answer)
