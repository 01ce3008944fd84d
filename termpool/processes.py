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


def this_process() -> dict:
    me = psutil.Process()
    return {"pid": me.pid, "started": round(me.create_time(), 2), "pidns": pid_namespace()}


def known_dead(facts: dict) -> bool:
    """True when the process is certainly gone: its pid is free, reused, or a zombie."""
    if not facts.get("pidns") or facts["pidns"] != pid_namespace():
        return False
    try:
        proc = psutil.Process(int(facts["pid"]))
        return abs(proc.create_time() - float(facts["started"])) > 0.05 or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, ValueError):
        return False


def owner_token() -> str:
    """A lock value naming its owner: machine, pid, start time, pid namespace, and a nonce."""
    me = this_process()
    return f"{socket.gethostname()}:{me['pid']}:{me['started']}:{me['pidns']}:{secrets.token_hex(4)}"


def owner_dead(token: str) -> bool:
    parts = token.rsplit(":", 4)
    if len(parts) != 5:
        return False
    return known_dead({"pid": parts[1], "started": parts[2], "pidns": parts[3]})
