"""The faults: kill -9 of one process of the stack (found by role in its process tree), or a
Redis restart. Each returns a description of what it did, for the report."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

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


def wait_in_flight(app, task_name: str, kind: str) -> dict | None:
    """The first running `task_name` on the `kind` worker (up to IN_FLIGHT_WAIT s), or None."""
    deadline = time.monotonic() + IN_FLIGHT_WAIT
    while time.monotonic() < deadline:
        for task in active_tasks(app):
            if task.get("name") == task_name and task["node"].startswith(kind + "-"):
                return task
        time.sleep(0.3)
    return None


def kill(proc: psutil.Process, role: str) -> dict:
    info = {"action": "kill -9", "role": role, "pid": proc.pid}
    try:
        info["cmdline"] = " ".join(proc.cmdline())[:160]
    except psutil.Error:
        pass
    os.kill(proc.pid, signal.SIGKILL)
    return info


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
