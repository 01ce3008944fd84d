"""Who a process is, and whether it is certainly gone (worker processes, lock owners).

A pid says something only inside one pid namespace of one boot of one kernel, and only with
its start time (pids are reused). Outside our namespace nothing is concluded: the caller
falls back to heartbeats and TTLs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
from pathlib import Path

import psutil


@functools.lru_cache(maxsize=1)
def pid_namespace() -> str:
    """This boot's pid namespace as a short id ("" off Linux: pids are then never compared)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return hashlib.sha256(f"{boot}/{ns}".encode()).hexdigest()[:12]


def start_ticks(pid: int) -> str:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat, field 22); ""
    when it is not there. Exact and monotonic: a wall-clock start time (psutil's create_time:
    boot time + ticks) moves when the kernel's idea of the boot time does, by a whole second
    whenever the clock is stepped or slewed across one, and live processes read as reused pids."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def this_process() -> dict:
    me = psutil.Process()
    return {
        "pid": me.pid,
        "started": round(me.create_time(), 2),
        "ticks": start_ticks(me.pid),
        "pidns": pid_namespace(),
    }


# Facts from before "ticks" (a worker of an older version, still running) compare wall-clock
# start times: within this much, the same process (see start_ticks for why not closer).
_WALL_CLOCK_SLACK = 2.0


def visible(facts: dict) -> bool:
    """The process is in this pid namespace: its pid says whether it lives (known_dead)."""
    return bool(facts.get("pidns")) and facts["pidns"] == pid_namespace()


def known_dead(facts: dict) -> bool:
    """True when the process is certainly gone: its pid is free, reused, or a zombie."""
    if not visible(facts):
        return False
    try:
        proc = psutil.Process(int(facts["pid"]))
        if facts.get("ticks"):
            reused = start_ticks(proc.pid) not in (str(facts["ticks"]), "")
        else:
            reused = abs(proc.create_time() - float(facts["started"])) > _WALL_CLOCK_SLACK
        return reused or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, ValueError):
        return False


def owner_token() -> str:
    """A lock value naming its owner: machine, pid, start time, pid namespace, and a nonce."""
    me = this_process()
    return f"{socket.gethostname()}:{me['pid']}:t{me['ticks']}:{me['pidns']}:{secrets.token_hex(4)}"


def owner_dead(token: str) -> bool:
    parts = token.rsplit(":", 4)
    if len(parts) != 5:
        return False
    started = parts[2]
    if started.startswith("t"):  # clock ticks since boot (an older owner wrote its wall-clock start)
        return known_dead({"pid": parts[1], "ticks": started[1:], "pidns": parts[3]})
    return known_dead({"pid": parts[1], "started": started, "pidns": parts[3]})
