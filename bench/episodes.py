"""One benchmark episode through each face: the pool API, the runs API, and the raw Docker SDK
(the floor). Every episode does the same work on the one-service fixture task hello-file:

    start a container  ->  N x `echo hi`  ->  write /app/hello.txt  ->  run the tests  ->  remove

Each timed operation is recorded in milliseconds in a Recorder; a failed operation is not timed
but counted as an error (with its message), and the episode's environment is still released.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.stats import Recorder
from termpool.client import Pool

TASK = "hello-file"
INSTRUCTION = "benchmark episode"
ECHO_COMMAND = "echo hi"
ECHO_OUTPUT = "hi"
HELLO_PATH = "/app/hello.txt"
HELLO_CONTENT = "Hello, world!\n"  # what the task's tests want: the episode scores 1.0
WRITTEN_PREFIX = "Content successfully written to"
HTTP_TIMEOUT = 900.0  # a single request never hangs the benchmark for ever
JOB_DEADLINE = 900.0  # longest wait for one job (a pool-API call's reply, a runs-API job)

POOL_OPS = ("allocate", "reset", "heartbeat", "tool_call", "write_file", "evaluate", "close")
RUNS_OPS = ("start", "tool_call", "write_file", "evaluate", "close")
FLOOR_OPS = ("create_start", "exec", "put_archive", "test_script", "remove")
FLOOR_EXTRA_OPS = ("copy_tests",)  # measured for the record; not part of any ratio


class EpisodeError(RuntimeError):
    pass


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _check_observation(op: str, observation, expected_start: str, exact: bool = False) -> None:
    text = observation if isinstance(observation, str) else repr(observation)
    good = text.strip() == expected_start if exact else text.startswith(expected_start)
    if not good:
        raise EpisodeError(f"{op}: unexpected observation {text[:200]!r}")


def _check_score(op: str, score) -> None:
    if score != 1.0:
        raise EpisodeError(f"{op}: score {score!r}, expected 1.0 (hello.txt was written before evaluating)")


# ---- both faces through termpool.client -------------------------------------------------------
class BenchClient(Pool):
    """termpool.client for one benchmark thread (one keep-alive connection pool), for both
    faces. No retries: a refused or failed operation is a measured error, not something to hide."""

    def __init__(self, url: str, token: str | None = None):
        super().__init__(url, token=token, timeout=HTTP_TIMEOUT, job_timeout=JOB_DEADLINE, retries=0)


def pool_episode(client: BenchClient, rec: Recorder, task_key: str, tool_calls: int) -> bool:
    """The blocking pool API: allocate, reset, heartbeat, tool calls, heartbeat, write, evaluate, close."""
    lease, op = None, "allocate"
    try:
        start = time.perf_counter()
        lease = client.allocate(task_key)
        rec.add("allocate", _ms_since(start))
        rec.run(lease.id)

        op = "reset"
        start = time.perf_counter()
        lease.reset(TASK, instruction=INSTRUCTION)
        rec.add("reset", _ms_since(start))
        if not isinstance(lease.tool_schemas, list) or not lease.tool_schemas:
            raise EpisodeError(f"reset: no tool_schemas in the reply ({lease.tool_schemas!r})")

        _heartbeat(lease, rec)
        op = "tool_call"
        for _ in range(tool_calls):
            start = time.perf_counter()
            observation = lease.exec(ECHO_COMMAND, id="bench", timeout=60)
            rec.add("tool_call", _ms_since(start))
            _check_observation(op, observation, ECHO_OUTPUT, exact=True)
        _heartbeat(lease, rec)

        op = "write_file"
        start = time.perf_counter()
        observation = lease.write_file(HELLO_PATH, HELLO_CONTENT)
        rec.add("write_file", _ms_since(start))
        _check_observation(op, observation, WRITTEN_PREFIX)

        op = "evaluate"
        start = time.perf_counter()
        score = lease.evaluate().score
        rec.add("evaluate", _ms_since(start))
        _check_score(op, score)

        op = "close"
        start = time.perf_counter()
        closing, lease = lease, None
        found = closing.close()
        rec.add("close", _ms_since(start))
        if not found:
            raise EpisodeError("close: found=false for a live lease")
        return True
    except Exception as exc:  # every failure is data, not a crash of the benchmark
        rec.error(f"pool {op}: {type(exc).__name__}: {exc}")
        return False
    finally:
        if lease is not None:
            try:
                lease.close()
            except Exception as exc:
                rec.error(f"pool close after a failure: {type(exc).__name__}: {exc}")


def _heartbeat(lease, rec: Recorder) -> None:
    """A router's keep-alive between steps (two per episode: after the reset, after the calls)."""
    start = time.perf_counter()
    lease.heartbeat()
    rec.add("heartbeat", _ms_since(start))


def runs_api_available(client: BenchClient) -> tuple[bool, str]:
    """Probe POST /v1/runs with an empty body: a route that exists refuses it with 400."""
    try:
        reply = client.request("POST", "/v1/runs", json={})
    except httpx.TransportError as exc:
        return False, f"probe failed: {exc}"
    if reply.status_code in (404, 405):
        return False, f"POST /v1/runs answers HTTP {reply.status_code}: the runs API is not implemented yet"
    if reply.status_code in (200, 202):  # it accepted an empty run: do not leave it behind
        try:
            run_id = reply.json().get("run_id")
            if run_id:
                client.request("DELETE", f"/v1/runs/{run_id}")
        except Exception:
            pass
        return True, "POST /v1/runs accepted an empty body (expected 400: task_meta missing)"
    return True, f"POST /v1/runs with an empty body answers HTTP {reply.status_code}"


def runs_episode(client: BenchClient, rec: Recorder, task_key: str, tool_calls: int) -> bool:
    """The runs API: start (and wait for it), tool calls, write, evaluate, close."""
    run, op = None, "start"
    try:
        start = time.perf_counter()
        run = client.start(TASK, task_key=task_key, instruction=INSTRUCTION, wait=False)
        rec.run(run.id)
        run.wait_ready()
        rec.add("start", _ms_since(start))
        if not run.tool_schemas:
            raise EpisodeError("start: no tool_schemas in the start job's result")

        op = "tool_call"
        for _ in range(tool_calls):
            start = time.perf_counter()
            observation = run.exec(ECHO_COMMAND, id="bench", timeout=60)
            rec.add("tool_call", _ms_since(start))
            _check_observation(op, observation, ECHO_OUTPUT, exact=True)

        op = "write_file"
        start = time.perf_counter()
        observation = run.write_file(HELLO_PATH, HELLO_CONTENT)
        rec.add("write_file", _ms_since(start))
        _check_observation(op, observation, WRITTEN_PREFIX)

        op = "evaluate"
        start = time.perf_counter()
        score = run.evaluate().score
        rec.add("evaluate", _ms_since(start))
        _check_score(op, score)

        op = "close"
        start = time.perf_counter()
        closing, run = run, None
        closing.close()
        rec.add("close", _ms_since(start))
        return True
    except Exception as exc:
        rec.error(f"runs {op}: {type(exc).__name__}: {exc}")
        return False
    finally:
        if run is not None:
            try:
                run.close()
            except Exception as exc:
                rec.error(f"runs DELETE after a failure: {type(exc).__name__}: {exc}")


# ---- the floor: the raw Docker SDK doing the same work --------------------------------------
def _tar(files: dict[str, bytes], mode: int = 0o644) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tests_tar(task_dir: Path) -> bytes:
    """The task's run-tests.sh and tests/ folder, laid out under /tests as the grader expects."""
    files = {"tests/run-tests.sh": (task_dir / "run-tests.sh").read_bytes()}
    for item in sorted((task_dir / "tests").iterdir()):
        if item.is_file():
            files[f"tests/{item.name}"] = item.read_bytes()
    return _tar(files, 0o755)


class Floor:
    """What termpool's reset, tool call, write, evaluate and close cost at the least: the same
    container options as termpool's direct start (environments/lifecycle.py), straight SDK calls."""

    def __init__(self, docker_client, image: str, mem_limit: str, task_dir: Path, workdir: Path, label: dict):
        self.docker = docker_client
        self.image = image
        self.mem_limit = mem_limit
        self.workdir = workdir
        self.label = label
        self.hello_tar = _tar({HELLO_PATH.lstrip("/"): HELLO_CONTENT.encode()})
        self.tests_tar = tests_tar(task_dir)

    def create_start(self, name: str, run_dir: Path, **extra):
        """The floor of a reset: one create (the SDK inspects the new container) and one start.
        `extra`: more create() options (a compose run's network, bench/density_host.py)."""
        container = self.docker.containers.create(
            self.image,
            command=["sh", "-c", "sleep infinity"],
            name=name,
            labels=self.label,
            environment={"TEST_DIR": "/tests"},
            volumes=[f"{run_dir / 'sessions'}:/logs", f"{run_dir / 'agent-logs'}:/agent-logs"],
            mem_limit=self.mem_limit,
            memswap_limit=self.mem_limit,
            privileged=False,
            init=True,
            **extra,
        )
        container.start()
        return container

    def episode(self, rec: Recorder, tool_calls: int) -> bool:
        name = f"tpbench-floor-{uuid.uuid4().hex[:12]}"
        run_dir = self.workdir / name
        (run_dir / "sessions").mkdir(parents=True, exist_ok=True)
        (run_dir / "agent-logs").mkdir(parents=True, exist_ok=True)
        container, op = None, "create_start"
        try:
            start = time.perf_counter()
            container = self.create_start(name, run_dir)
            rec.add("create_start", _ms_since(start))

            op = "exec"
            for _ in range(tool_calls):
                start = time.perf_counter()
                result = container.exec_run(["bash", "-c", ECHO_COMMAND])
                rec.add("exec", _ms_since(start))
                if (result.output or b"").decode(errors="replace").strip() != ECHO_OUTPUT:
                    raise EpisodeError(f"exec: unexpected output {result.output[:200]!r}")

            op = "put_archive"
            start = time.perf_counter()
            ok = container.put_archive("/", self.hello_tar)
            rec.add("put_archive", _ms_since(start))
            if not ok:
                raise EpisodeError("put_archive refused")

            op = "copy_tests"
            start = time.perf_counter()
            if not container.put_archive("/", self.tests_tar):
                raise EpisodeError("put_archive of the tests refused")
            rec.add("copy_tests", _ms_since(start))

            op = "test_script"
            start = time.perf_counter()
            result = container.exec_run(
                ["bash", "/tests/run-tests.sh"], user="root", environment={"TEST_DIR": "/tests"}
            )
            rec.add("test_script", _ms_since(start))
            output = (result.output or b"").decode(errors="replace")
            if result.exit_code != 0 or "2 passed" not in output:
                raise EpisodeError(f"test_script: exit {result.exit_code}, output {output[-300:]!r}")

            op = "remove"
            start = time.perf_counter()
            container.remove(force=True, v=True)
            rec.add("remove", _ms_since(start))
            container = None
            return True
        except Exception as exc:
            rec.error(f"floor {op}: {type(exc).__name__}: {exc}")
            return False
        finally:
            if container is not None:
                try:
                    container.remove(force=True, v=True)
                except Exception as exc:
                    rec.error(f"floor remove after a failure: {type(exc).__name__}: {exc}")


def run_phase(concurrency: int, episodes_per_worker: int, make_ctx, episode, close_ctx=None) -> tuple[Recorder, float]:
    """c threads, each running its episodes back to back; returns the samples and the wall time
    from the moment every thread was ready to the end of the last episode."""
    rec = Recorder()
    started = [0.0]
    barrier = threading.Barrier(concurrency, action=lambda: started.__setitem__(0, time.perf_counter()))

    def worker(index: int) -> None:
        ctx = None
        try:
            ctx = make_ctx(index)
        except Exception as exc:
            rec.error(f"worker setup: {type(exc).__name__}: {exc}")
        try:
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            rec.error("worker start barrier broken")
            return
        if ctx is None:
            return
        try:
            for _ in range(episodes_per_worker):
                rec.episode_done(episode(ctx, index, rec))
        finally:
            if close_ctx:
                close_ctx(ctx)

    threads = [threading.Thread(target=worker, args=(i,), name=f"bench-{i}", daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rec, time.perf_counter() - (started[0] or time.perf_counter())
