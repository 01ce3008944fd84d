"""What callers build and get back: tool calls, a start's task_meta, an evaluation, an episode."""

from __future__ import annotations

from dataclasses import dataclass, field

from termpool.client.errors import TermpoolError


def tool_call(name: str, **arguments) -> dict:
    """One tool call as the API takes it, e.g. in an episode's script."""
    return {"name": name, "arguments": arguments}


def exec_call(command: str, *, id: str = "main", block: bool | None = True, timeout: float | None = 20.0) -> dict:
    """shell_exec: `bash -c command` in /workspace; non-blocking (block=False) starts session `id`."""
    return tool_call("shell_exec", id=id, command=command, block=block, timeout=timeout)


def write_file_call(path: str, content: str) -> dict:
    """shell_write_content_to_file: `content` as UTF-8, unchanged, to `path`."""
    return tool_call("shell_write_content_to_file", content=content, file_path=path)


def task_meta(task: str, task_path: str | None = None, instruction: str | None = None) -> dict:
    """The task_meta of a start (POST /v1/runs, POST /reset): the task folder's name, its
    path under the service's DATASET_DIR (default: the name) and the instruction."""
    return {"task_name": task, "task_path": task_path or task, "instruction": instruction or ""}


# ---- results --------------------------------------------------------------------------------
@dataclass
class Evaluation:
    score: float  # the fraction of the task's tests that passed (a Harbor task: its reward)
    tests: dict  # test name -> "passed" / "failed"
    rewards: dict = field(default_factory=dict)  # a Harbor task's named rewards


@dataclass
class Episode:
    """The outcome of a one-shot episode (Pool.episode)."""

    run_id: str
    state: str
    score: float | None
    tests: dict
    observations: list  # the script's tool call results, in order (None for a step that failed)
    jobs: list  # every step's job record, in order
    run: dict  # the final run record
    failure: TermpoolError | None = None  # the first failed step's error
