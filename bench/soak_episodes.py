"""The soak's episode kinds, each a real run (or two) through the runs API with termpool.client.

Every kind is cheap (a few tool calls), and each checks its own outcome: an expected failure
(a broken build, a call on a closed run) must fail with its own error, a solved run must score
1.0 and an unsolved one 0.0. An episode that does otherwise raises SoakError.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from devstack import FIXTURES
from termpool.client import Pool, RunClosed, TaskBuildFailed

HELLO = "hello-file"
COMPOSE = "two-service-small"  # agent + a perl sidecar, no healthcheck: the cheapest compose task
BROKEN = "broken-dockerfile"
HELLO_PATH, HELLO_TEXT = "/app/hello.txt", "Hello, world!\n"
PROBE = "exec 3<>/dev/tcp/side/7000; head -n 1 <&3"
UPLOADS_PER_VARIANT = 4  # a new uploaded task (a new digest, so a new image) every 4 uploads

# kind -> weight in every 20 episodes
MIX = {
    "solved": 4,
    "unsolved": 2,
    "compose": 3,
    "fork": 2,
    "upload": 2,
    "transfer": 3,
    "reaped": 1,
    "broken_build": 1,
    "closed_call": 2,
}
KINDS = [kind for kind, weight in MIX.items() for _ in range(weight)]


class SoakError(RuntimeError):
    pass


def kind_of(index: int) -> str:
    """The kind of episode number `index`: the mix, interleaved (5 % steps of 20)."""
    return KINDS[(index * 7) % len(KINDS)]  # 7 is prime to 20: every kind in every 20


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise SoakError(what)


class Episodes:
    """The episodes of one soak thread: its own Pool (one keep-alive connection pool), its own
    task key (capacity counts runs per key), its scratch folder for transfers and uploads."""

    def __init__(self, url: str, thread: int, scratch: Path):
        self.pool = Pool(url, timeout=300, job_timeout=600, retries=2)
        self.key = f"soak-{thread}"
        self.scratch = scratch / f"t{thread}"
        self.scratch.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        self.pool.close()

    def run(self, index: int, kind: str) -> None:
        getattr(self, "ep_" + kind)(index)

    def _start(self, task: str, **kw):
        return self.pool.start(task, task_key=self.key, instruction="soak", **kw)

    def ep_solved(self, index: int) -> None:
        with self._start(HELLO) as run:
            _expect(run.exec("echo hi").strip() == "hi", "echo")
            run.write_file(HELLO_PATH, HELLO_TEXT)
            score = run.evaluate().score
            _expect(score == 1.0, f"solved scored {score}")

    def ep_unsolved(self, index: int) -> None:
        with self._start(HELLO) as run:
            run.exec("ls /app")
            score = run.evaluate().score
            _expect(score == 0.0, f"unsolved scored {score}")

    def ep_compose(self, index: int) -> None:
        with self._start(COMPOSE) as run:
            out = run.exec(PROBE, timeout=30)
            _expect(out.startswith("pong"), f"sidecar probe answered {out[:100]!r}")

    def ep_fork(self, index: int) -> None:
        with self._start(HELLO) as run:
            run.write_file(HELLO_PATH, HELLO_TEXT)
            (child,) = run.fork(1)
            with child:
                _expect(child.exec(f"cat {HELLO_PATH}").strip() == HELLO_TEXT.strip(), "fork lost the file")

    def ep_upload(self, index: int) -> None:
        every = len(KINDS) // MIX["upload"] * UPLOADS_PER_VARIANT  # episodes between two new variants
        task_path = self.pool.upload_task(self._variant(index // every))
        with self._start(HELLO, task_path=task_path) as run:
            run.write_file(HELLO_PATH, HELLO_TEXT)
            _expect(run.evaluate().score == 1.0, "uploaded task not solved")

    def _variant(self, variant: int) -> Path:
        """hello-file with one comment line of its own: a task of a new digest."""
        folder = self.scratch / f"upload-{variant}"
        if not folder.is_dir():
            shutil.copytree(FIXTURES / HELLO, folder)
            with open(folder / "Dockerfile", "a") as f:
                f.write(f"# soak variant {variant}\n")
        return folder

    def ep_transfer(self, index: int) -> None:
        local = self.scratch / "up.bin"
        local.write_bytes(bytes(range(256)) * 256)  # 64 KiB
        with self._start(HELLO) as run:
            result = run.command("sha256sum /etc/hostname && echo done", timeout_sec=30)
            _expect(result.return_code == 0 and "done" in result.stdout, f"command: {result}")
            run.upload_file(str(local), "/tmp/up.bin")
            back = self.scratch / "down.bin"
            run.download_file("/tmp/up.bin", str(back))
            _expect(back.read_bytes() == local.read_bytes(), "download differs from upload")

    def ep_reaped(self, index: int) -> None:
        run = self._start(HELLO)
        run.exec("echo left for the reaper")  # never closed: WORKER_RUN_IDLE_TTL reaps it

    def ep_broken_build(self, index: int) -> None:
        try:
            self._start(BROKEN)
        except TaskBuildFailed:
            return
        raise SoakError("broken-dockerfile started")

    def ep_closed_call(self, index: int) -> None:
        run = self._start(HELLO)
        run.close()
        try:
            run.exec("echo too late")
        except RunClosed:
            return
        raise SoakError("a tool call on a closed run answered")


def scratch_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="termpool-soak-"))
