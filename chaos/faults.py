"""The faults: kill -9 of one process of the stack (found by role in its process tree), a
Redis restart, SIGSTOP of one kind's workers, kill -9 of the whole stack and a relaunch, a
Redis partition (iptables), busy loops. Each returns a description of what it did, for the
report; a fault with an end (its `mark`) also returns when it ended (`mark_at`, monotonic), so
failures after it can be counted apart."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import psutil
import redis

from chaos.service import Service

# The Celery task a worker kill waits for, so the kill hits work in flight.
IN_FLIGHT = {
    "build": "pool.ensure_image",
    "build-child": "pool.ensure_image",
    "lifecycle": "pool.start_run",
    "exec": "pool.exec_tool",
    "eval": "pool.evaluate",
    "teardown": "pool.close_run",
}
IN_FLIGHT_WAIT = 40.0
REDIS_DOWN_SECONDS = 5.0
REDIS_SETTINGS = (
    "port",
    "bind",
    "dir",
    "dbfilename",
    "save",
    "appendonly",
    "appendfsync",
    "appenddirname",
    "appendfilename",
    "maxmemory-policy",
    "protected-mode",
    "daemonize",
    "logfile",
    "pidfile",
)


def active_tasks(app) -> list[dict]:
    """Tasks running now on this stack's workers (Celery's inspect over the private broker)."""
    try:
        replies = app.control.inspect(timeout=1.0).active() or {}
    except Exception:  # the broker may be down: nothing can be seen, not an error of the run
        return []
    return [dict(task, node=node) for node, tasks in replies.items() for task in tasks or []]


def wait_in_flight(app, task_name: str, kind: str, timeout: float = IN_FLIGHT_WAIT) -> dict | None:
    """The first running `task_name` on the `kind` worker (up to `timeout` s), or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in active_tasks(app):
            if task.get("name") == task_name and task["node"].startswith(kind + "-"):
                return task
        time.sleep(0.3)
    return None


# A Redis or Docker outage is aimed at the work that suffers most from it: a reset and an
# evaluation running at once, else an evaluation alone (up to IN_FLIGHT_WAIT in all).
def wait_reset_and_eval(store, prefer_both_for: float, timeout: float = IN_FLIGHT_WAIT) -> dict:
    """Wait until a reset (a `start` job) and an evaluation are running at the same time (the
    jobs worker processes hold, from the state store); after `prefer_both_for` s, an evaluation
    alone will do. What ran when the wait ended, for the fault's record."""
    began, kinds = time.monotonic(), []
    while time.monotonic() - began < timeout:
        kinds = sorted(store.running_kinds())
        if "evaluation" in kinds and ("start" in kinds or time.monotonic() - began >= prefer_both_for):
            break
        time.sleep(0.02)  # a reset from the warm pool runs a few hundred ms
    return {"in_flight": kinds, "reset_and_eval_in_flight": "evaluation" in kinds and "start" in kinds}


def kill(proc: psutil.Process, role: str) -> dict:
    info = {"action": "kill -9", "role": role, "pid": proc.pid, "cmdline": _cmdline(proc)}
    os.kill(proc.pid, signal.SIGKILL)
    return info


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:160]
    except psutil.Error:
        return ""


def kill_role(service: Service, role: str, app) -> dict:
    """kill -9 of the main process of a Procfile role, once its kind of job is in flight."""
    task = wait_in_flight(app, IN_FLIGHT[role], role) if role in IN_FLIGHT else None
    proc = service.mains().get(role)
    if proc is None:
        return {"action": "none", "role": role, "error": f"no {role} process in the stack's tree"}
    info = kill(proc, role)
    info["in_flight"] = task.get("name") if task else None
    return info


def kill_build_child(service: Service, app) -> dict:
    """kill -9 of the prefork child of the build worker that is running the build."""
    task = wait_in_flight(app, IN_FLIGHT["build-child"], "build")
    children = service.children_of("build")
    if not children:
        return {"action": "none", "role": "build child", "error": "the build worker has no prefork child"}
    chosen = [c for c in children if task and c.pid == task.get("worker_pid")]
    info = kill(chosen[0] if chosen else children[0], "build child")
    info["in_flight"] = task.get("name") if task else None
    info["child_running_the_build"] = bool(chosen)
    return info


# ---- Redis restart --------------------------------------------------------------------------
def redis_command(service: Service, pid: int) -> tuple[list[str], str]:
    """The command line to start Redis again. /proc/<pid>/cmdline has it unless Redis rewrote
    its process title (it does by default: "redis-server 127.0.0.1:6379"); then it is rebuilt
    from the running server's own settings (CONFIG GET), which is the same configuration."""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = [a.decode() for a in fh.read().split(b"\0") if a]
    title = len(argv) == 1 and " " in argv[0] or (len(argv) > 1 and re.fullmatch(r"\S*:\d+", argv[1]) is not None)
    if not title:
        return argv, "/proc/cmdline"
    # Not psutil's exe(): Debian's redis-server is a symlink whose target picks its mode by name.
    program = argv[0].split()[0]
    program = program if os.path.isabs(program) else shutil.which(program) or program
    config = service.redis.config_get("*")
    config_file = service.redis.info("server").get("config_file") or ""
    command = [program] + ([config_file] if config_file else [])
    for key in REDIS_SETTINGS:
        value = config.get(key)
        if value is None or (value == "" and key != "save"):
            continue
        command += [f"--{key}", *(value.split() or [""])]
    return command, "CONFIG GET (the process title hides the arguments)"


def restart_redis(service: Service) -> dict:
    """SHUTDOWN NOSAVE, then start it again REDIS_DOWN_SECONDS later with the same command line
    (unless something, a supervisor, brought it back already)."""
    pid = service.redis_pid()
    if pid is None:
        return {"action": "none", "role": "redis", "error": "nothing listens on the Redis port"}
    command, source = redis_command(service, pid)
    info = {
        "action": "redis SHUTDOWN NOSAVE + restart",
        "role": "redis",
        "pid": pid,
        "command": " ".join(command),
        "command_from": source,
    }
    down_at = time.monotonic()
    try:
        service.redis.shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # the connection closes as the server exits
    try:
        psutil.Process(pid).wait(timeout=10)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass
    time.sleep(max(0.0, REDIS_DOWN_SECONDS - (time.monotonic() - down_at)))
    if redis_answers(service):
        info["restarted_by"] = "someone else (a supervisor)"
        return info
    daemon = "--daemonize" in command and command[command.index("--daemonize") + 1] == "yes"
    started = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    if daemon:
        try:
            started.wait(timeout=10)  # the parent exits once the daemon has forked
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10
    while not redis_answers(service) and time.monotonic() < deadline:
        time.sleep(0.1)
    info["restarted_by"] = "the harness"
    info["new_pid"] = service.redis_pid()
    info["down_seconds"] = round(time.monotonic() - down_at, 1)
    return info


def redis_answers(service: Service) -> bool:
    try:
        return bool(service.redis.ping())
    except redis.RedisError:
        return False


# ---- undo, whatever happens ---------------------------------------------------------------
class Undo:
    """Faults that must be undone whatever happens (stopped processes, packet-filter rules).
    The fault undoes itself when it ends; the scenario calls close() in a finally, which
    undoes what is still in place and refuses any fault that comes later. Each undo runs once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[Callable[[], None]] = []
        self._closed = False

    def apply(self, do: Callable[[], None], undo: Callable[[], None]) -> Callable[[], None]:
        """do(), with `undo` registered before it starts (a do() that fails half way is undone
        at once); returns the handle for undo()."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the scenario ended before the fault: not applied")
            self._pending.append(undo)
            try:
                do()
            except BaseException:
                self._pending.remove(undo)
                undo()
                raise
        return undo

    def undo(self, handle: Callable[[], None]) -> None:
        with self._lock:
            if handle not in self._pending:
                return  # close() undid it already
            self._pending.remove(handle)
        handle()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, []
        errors = []
        for handle in reversed(pending):
            try:
                handle()
            except Exception as exc:  # the others are still undone
                errors.append(exc)
        if errors:
            raise RuntimeError(f"could not undo every fault: {errors}")


# ---- SIGSTOP of one kind's workers --------------------------------------------------------
FREEZE_SECONDS = 30.0
# A stop needs no job in flight to matter (calls sent while it lasts wait for the kind, jobs
# queued meanwhile finish late), only episodes still running: a short wait for one, then stop.
FREEZE_IN_FLIGHT_WAIT = 5.0


def _suspend_tree(main: psutil.Process, stopped: list[psutil.Process]) -> None:
    """SIGSTOP the main process first (stopped, it forks no new child), then every process
    under it, until a fresh look finds no new one. psutil signals by pid, checking the pid is
    still the same process."""
    main.suspend()
    stopped.append(main)
    for _ in range(3):
        done = {proc.pid for proc in stopped}
        new = [proc for proc in main.children(recursive=True) if proc.pid not in done]
        if not new:
            return
        for proc in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.suspend()
                stopped.append(proc)


def _resume(stopped: list[psutil.Process]) -> None:
    """SIGCONT, children first: the main process wakes up to a pool that is whole."""
    for proc in reversed(stopped):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.resume()


def freeze_role(service: Service, kind: str, app, undo: Undo) -> dict:
    """SIGSTOP of a queue kind's main worker process and every process under it (the build
    worker's prefork children) for FREEZE_SECONDS, once its kind of job is in flight (or
    FREEZE_IN_FLIGHT_WAIT s have passed), then SIGCONT. Hung, not dead: the same pids serve
    again afterwards."""
    task = wait_in_flight(app, IN_FLIGHT[kind], kind, FREEZE_IN_FLIGHT_WAIT)
    main = service.mains().get(kind)
    if main is None:
        return {"action": "none", "role": kind, "error": f"no {kind} process in the stack's tree"}
    stopped: list[psutil.Process] = []
    handle = undo.apply(lambda: _suspend_tree(main, stopped), lambda: _resume(stopped))
    began = time.monotonic()
    pids = [{"pid": p.pid, "what": "main" if p is main else "child", "cmdline": _cmdline(p)} for p in stopped]
    time.sleep(FREEZE_SECONDS)
    undo.undo(handle)
    ended = time.monotonic()
    return {
        "action": "SIGSTOP, SIGCONT later",
        "role": kind,
        "stopped": pids,
        "stopped_s": round(ended - began, 1),
        "in_flight": task.get("name") if task else None,
        "note": f"pids {','.join(str(p['pid']) for p in pids)} stopped {ended - began:.1f} s",
        "mark": "sigcont",
        "mark_at": ended,
    }


# ---- the whole stack: kill -9 and relaunch ------------------------------------------------
RELAUNCH_WAIT = 120.0  # for /healthz, then for /readyz: past it the stack "never" came back


def restart_stack(service: Service) -> dict:
    """kill -9 of every process of the stack and of its Redis (a power loss; containers
    stay), and serve.sh launched again at once with the same settings (Redis comes back from
    its append-only file). Waits for the first /healthz 200 only, as a router resumes then;
    /readyz is only timed."""
    killed = service.kill_everything()
    info = {"action": "kill -9 stack + Redis, relaunch", "role": "all", "killed_pids": killed}
    relaunched = time.monotonic()
    service.launch()
    try:
        service.wait_healthy(RELAUNCH_WAIT)
    except RuntimeError as exc:  # it did not come back: recovery says "never"
        info.update(healthz_s=None, error_after_relaunch=str(exc), note="/healthz never answered")
        return info
    healthy = time.monotonic()
    ready = wait_readyz(service, RELAUNCH_WAIT)
    info.update(
        healthz_s=round(healthy - relaunched, 1),
        readyz_s=None if ready is None else round(ready - relaunched, 1),
        mark="healthz",
        mark_at=healthy,
    )
    info["note"] = f"/healthz {info['healthz_s']} s, /readyz {info['readyz_s'] or 'never'} s after relaunch"
    return info


def wait_readyz(service: Service, timeout: float) -> float | None:
    """When (monotonic) GET /readyz first answered 200; None if not within `timeout`."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=service.url, timeout=2, trust_env=False) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if http.get("/readyz").status_code == 200:
                    return time.monotonic()
            time.sleep(0.1)
    return None


# ---- Redis partition ----------------------------------------------------------------------
PARTITION_SECONDS = 10.0


def partition_tag(service: Service) -> str:
    """The comment on this service's packet-filter rules: no other rule carries it."""
    return f"chaos-partition-{service.host_id}"


def partition_rules(port: int, tag: str) -> list[list[str]]:
    """iptables rules (chain first) that DROP loopback TCP of one port both ways: packets into
    it (INPUT --dport) and out of it (OUTPUT --sport). A DROP, not a REJECT: the peers hear
    nothing, as across a partition, and their connections survive it."""
    comment = ["-m", "comment", "--comment", tag]
    return [
        ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), *comment, "-j", "DROP"],
        ["OUTPUT", "-o", "lo", "-p", "tcp", "--sport", str(port), *comment, "-j", "DROP"],
    ]


def iptables(*args: str) -> subprocess.CompletedProcess:
    # -w: wait for the xtables lock (the workers' containment rules take it too)
    return subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True, timeout=30)


def add_rules(rules: list[list[str]]) -> None:
    for rule in rules:
        done = iptables("-I", *rule)
        if done.returncode:
            raise RuntimeError(f"iptables -I {' '.join(rule)}: {done.stderr.strip()}")


def remove_rules(rules: list[list[str]]) -> None:
    """Delete each rule by its spec while -C finds it, retrying an iptables that fails."""
    left = []
    for rule in rules:
        for _ in range(10):
            found = iptables("-C", *rule).returncode
            if found == 1:
                break  # not there (any more)
            if found == 0 and iptables("-D", *rule).returncode == 0:
                continue
            time.sleep(0.5)
        else:
            left.append(" ".join(rule))
    if left:
        raise RuntimeError(f"packet-filter rules left in place: {left}")


def redis_rules(service: Service) -> list[list[str]]:
    """The partition's rules: on the service's private Redis port, never another."""
    if service.env["REDIS_URL"] != f"redis://127.0.0.1:{service.redis_port}/0":
        raise RuntimeError(f"the service's Redis is not its private one: {service.env['REDIS_URL']}")
    return partition_rules(service.redis_port, partition_tag(service))


def check_partition(service: Service) -> None:
    """Before the service starts (nothing listens on its Redis port yet): the rules can be
    added and removed here, else the scenario is an error, not a run without its fault."""
    if shutil.which("iptables") is None:
        raise RuntimeError("iptables is not installed: redis-partition cannot run")
    rules = redis_rules(service)
    try:
        add_rules(rules)
    finally:
        remove_rules(rules)


def freeze_redis(service: Service, undo: Undo, seconds: float) -> dict:
    """SIGSTOP of the service's redis-server for `seconds`, then SIGCONT: a Redis that accepts
    connections (the kernel does) and answers nothing, as a hung host does."""
    pid = service.redis_pid()
    if pid is None:
        return {"action": "none", "role": "redis", "error": "nothing listens on the Redis port"}
    handle = undo.apply(lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT))
    began = time.monotonic()
    time.sleep(seconds)
    undo.undo(handle)
    ended = time.monotonic()
    return {
        "action": "SIGSTOP, SIGCONT later",
        "role": "redis",
        "pid": pid,
        "stopped_s": round(ended - began, 1),
        "note": f"pid {pid} stopped {ended - began:.1f} s",
        "mark": "sigcont",
        "mark_at": ended,
    }


def partition_redis(service: Service, undo: Undo, seconds: float = PARTITION_SECONDS) -> dict:
    """Drop every packet to and from the service's Redis for `seconds`, then remove exactly
    those rules."""
    rules = redis_rules(service)
    handle = undo.apply(lambda: add_rules(rules), lambda: remove_rules(rules))
    began = time.monotonic()
    time.sleep(seconds)
    undo.undo(handle)
    ended = time.monotonic()
    return {
        "action": "iptables DROP both ways, then -D",
        "role": "redis",
        "port": service.redis_port,
        "rules": [" ".join(rule) for rule in rules],
        "dropped_s": round(ended - began, 1),
        "note": f"port {service.redis_port} dropped {ended - began:.1f} s",
        "mark": "partition_end",
        "mark_at": ended,
    }


# ---- CPU saturation -----------------------------------------------------------------------
@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[int]]:
    """`count` Python busy loops while the block runs, killed by pid at its end whatever
    happens; yields their pids."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # Popen signals its own child only while it has not reaped it
        for proc in procs:
            proc.wait(timeout=10)
