"""The bundled examples (examples/tasks) served by a stack of their own, as scripts/serve.sh
serves them by default: every example's oracle scores 1.0 through the API (the quick start's
`dataset oracle` command), a partial answer to text-stats gets a partial reward, and the
interactive quiz is solved the way an agent would, through a non-blocking session."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from devstack import ROOT, Stack
from termpool.client import Pool, exec_call, write_file_call
from tests.conftest import make_app, stop_checking_leaks, wait_for

EXAMPLES = ROOT / "examples" / "tasks"
TASKS = ("count-errors", "inventory-total", "quiz", "sales-summary", "text-stats")  # sales-summary: Harbor's format


@pytest.fixture(scope="module")
def examples_stack(docker_client):
    subprocess.run(["bash", str(ROOT / "scripts" / "base_image.sh")], check=True, capture_output=True)
    stack = Stack(env={"DATASET_DIR": str(EXAMPLES)}).start()
    yield stack
    stop_checking_leaks(stack, docker_client)


@pytest.fixture
def pool(examples_stack):
    with Pool(examples_stack.url) as p:
        yield p


def test_every_example_oracle_scores_one(examples_stack, tmp_path):
    """The quick start's command: the examples are the default when DATASET_DIR does not exist."""
    app = make_app(
        {
            "DATASET_DIR": str(tmp_path / "nothing-here"),
            "REDIS_URL": "redis://127.0.0.1:1/0",
            "TBENCH_OUTPUT_ROOT": str(tmp_path / "out"),
        }
    )
    result = app.test_cli_runner().invoke(
        args=["dataset", "oracle", "--url", examples_stack.url, "-j", "4", "--report", str(tmp_path / "report.json")],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(t["task"] for t in report["tasks"]) == list(TASKS)
    assert all(t["reward"] == 1.0 for t in report["tasks"]), report["tasks"]
    assert result.stdout.rstrip().splitlines()[-len(TASKS) :] == [f"{task}: reward 1.00 (passed)" for task in TASKS]


def test_partial_answer_gets_partial_reward(pool):
    text = (EXAMPLES / "text-stats" / "input.txt").read_text()
    partial = json.dumps({"lines": len(text.splitlines()), "words": len(text.split()), "longest_word": "pool"})
    episode = pool.episode("text-stats", [write_file_call("/app/stats.json", partial)])
    assert episode.score == 0.75 and episode.tests["test_longest_word"] == "failed"

    nothing = pool.episode("text-stats", [exec_call("true")])
    assert nothing.score == 0.0 and set(nothing.tests.values()) == {"failed"}


def test_harbor_example_partial_reward(pool):
    """sales-summary's verifier writes reward.json: one named reward per field, `reward` their mean."""
    partial = json.dumps({"count": 7, "total": 585, "top_region": "north"})
    episode = pool.episode("sales-summary", [write_file_call("/app/summary.json", partial)])
    assert episode.score == pytest.approx(2 / 3)
    assert episode.run["rewards"] == {"reward": pytest.approx(2 / 3), "count": 1.0, "total": 1.0, "top_region": 0.0}


def until_prompt(run, screen: str) -> str:
    """The session's output up to its next `answer> ` prompt: the question and the prompt can
    arrive in separate reads, so reads are joined."""
    seen = [screen]

    def prompt() -> str:
        if "answer> " not in seen[-1]:
            seen.append(run.view("quiz"))
        text = "".join(seen)
        return text[text.rfind("what is") :] if "answer> " in text[text.rfind("what is") :] else ""

    return wait_for(prompt, 30)


def test_quiz_through_a_non_blocking_session(pool):
    with pool.start("quiz") as run:
        assert run.exec("quiz", id="quiz", block=False).startswith("Session 'quiz' started.")
        screen = until_prompt(run, "")
        for turn in range(3):
            a, op, b = re.findall(r"what is (\d+) ([-+*]) (\d+)\?", screen)[-1]
            screen = run.write_to_process("quiz", str(eval(f"{a} {op} {b}")))
            assert "Correct!" in screen
            if turn < 2:
                screen = until_prompt(run, screen)
        assert "All three correct" in (screen if "All three" in screen else screen + run.view("quiz"))
        assert run.evaluate().score == 1.0


def test_sidecar_serves_each_run_its_own_inventory(pool):
    """Two runs of the two-service example at once: each client sees its own sidecar."""
    fetch = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://inventory:8000/items').read().decode())\""
    with pool.start("inventory-total") as first, pool.start("inventory-total") as second:
        items = [json.loads(run.exec(fetch)) for run in (first, second)]
        assert all(len(found) == 5 for found in items) and items[0] != items[1]
        total = sum(item["quantity"] for item in items[0])
        first.write_file("/app/total.txt", f"{total}\n")
        assert first.evaluate().score == 1.0
    started = time.monotonic()
    assert wait_for(lambda: not pool.status()["tasks"].get("inventory-total"), 120), time.monotonic() - started


def test_best_of_k_forks_and_keeps_the_best_reward(examples_stack):
    """examples/best_of_k.py: K children of one run at step 2, each evaluated; the best is 1.0."""
    proc = subprocess.run(
        ["python3", str(ROOT / "examples" / "best_of_k.py"), examples_stack.url, "--fork-at", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**examples_stack.env, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    rewards = [float(re.search(r"reward (\S+)", line)[1]) for line in lines[:-1]]
    assert len(rewards) == 3 and len(set(rewards)) > 1, proc.stdout  # the children's futures differ
    assert lines[-1] == "best of 3 from step 2: reward 1.00 (awk on the level field)", proc.stdout
