"""gunicorn settings for the facade: threads, because pool calls block while their job runs."""

import glob
import os
import shutil
import tempfile

from poolcore.config import settings

_cfg = settings()
bind = f"0.0.0.0:{_cfg.port}"
worker_class = "gthread"
workers = _cfg.web_workers
threads = _cfg.web_threads  # each blocking /reset or /evaluate holds one thread
loglevel = _cfg.log_level.lower()
# Off by default: a line per request is CPU on the per-call path, and /metrics counts every
# request with its latency by route and status already.
accesslog = "-" if _cfg.access_log else None
graceful_timeout = 30
# Idle keep-alive connections stay open longer than clients keep them (httpx: 5 s, requests:
# until reused): gunicorn's default of 2 s closes them under a client that is about to send
# on one, and that request fails ("server disconnected") though nothing was wrong.
keepalive = 75


# ---- priority -------------------------------------------------------------------------------
# Every pool call someone waits on passes through the facade, and each costs it about a
# millisecond of CPU, while the workers, dockerd and the task containers keep a busy host's
# cores full. Ahead of them (WEB_NICE, default -5), a call waits for a core far less; the
# facade's small share of the CPU takes little from them. Workers inherit it from the master.
def _set_priority(nice: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:  # no CAP_SYS_NICE (a container without it): run at the default
        print(f"termpool: WEB_NICE={nice} not applied ({exc}); the facade runs at the default priority", flush=True)


if _cfg.web_nice != os.getpriority(os.PRIO_PROCESS, 0):
    _set_priority(_cfg.web_nice)


# ---- this instance's runtime folder -----------------------------------------------------------
# One folder per gunicorn instance of a host, named by its port (two instances cannot share
# one): it holds the Prometheus files and the control socket. A fixed path, not a fresh
# temporary one, so a master killed without cleanup leaves one folder that its successor on
# the same port reuses, instead of one more each time.
def _runtime_dir(port: int) -> str:
    if os.geteuid() == 0:
        base = "/run/termpool-web"
    else:
        base = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"termpool-web-{os.getuid()}")
    path = os.path.join(base, str(port))
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(base).st_uid != os.geteuid():  # a shared /tmp: never use a folder someone else made
        raise RuntimeError(f"{base} belongs to another user")
    return path


_RUNTIME_DIR = _runtime_dir(_cfg.port)

# gunicornc's control socket: per instance (by default every root gunicorn of a host would
# share /root/.gunicorn/gunicorn.ctl, each new one taking it over from the last).
# `gunicornc -s <runtime dir>/gunicorn.ctl` reaches this one.
control_socket = os.path.join(_RUNTIME_DIR, "gunicorn.ctl")

# ---- Prometheus multiprocess mode (app/metrics.py) ------------------------------------------
# Every worker process writes its request metrics to files in PROMETHEUS_MULTIPROC_DIR and a
# scrape sums them all. prometheus_client reads the variable when it is first imported, so it
# is set here, in the master, before any worker loads the app. Unset: the instance's
# runtime folder, emptied when the master starts and removed when it exits.
_PRIVATE_MARK = "TERMPOOL_PRIVATE_PROMETHEUS_DIR"
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ[_PRIVATE_MARK] = os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(_RUNTIME_DIR, "prometheus")
os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)


def on_starting(server):
    """Values of an earlier gunicorn must not count: start from an empty folder."""
    for path in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def child_exit(server, worker):
    """A worker is gone: drop its live gauges (its counters and histograms stay summed)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    private = os.environ.get(_PRIVATE_MARK)
    if private and private == os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(private, ignore_errors=True)
    try:
        os.rmdir(_RUNTIME_DIR)  # gone when nothing else is left in it (the socket is removed by now)
    except OSError:
        pass
