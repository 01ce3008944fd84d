from pathlib import Path

ANSWER = Path("/app/errors.txt")


def expected() -> int:
    lines = Path("/app/server.log").read_text().splitlines()
    return sum(1 for line in lines if line.split()[1:2] == ["ERROR"])


def test_answer_file_exists():
    assert ANSWER.is_file(), f"{ANSWER} does not exist"


def test_answer_is_the_error_count():
    assert ANSWER.read_text().strip() == str(expected())
