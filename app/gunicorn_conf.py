"""gunicorn settings for the facade: threads, because pool calls block while their job runs."""
import glob
import os
import shutil
import tempfile

from termpool.config import settings

_cfg = settings()
bind = f"0.0.0.0:{_cfg.port}"
worker_class = "gthread"
workers = _cfg.web_workers
threads = _cfg.web_threads  # each blocking /reset or /evaluate holds one thread
loglevel = _cfg.log_level.lower()
accesslog = "-"
graceful_timeout = 30

# ---- Prometheus multiprocess mode (app/metrics.py) ------------------------------------------
# Every worker process writes its request metrics to files in PROMETHEUS_MULTIPROC_DIR and a
# scrape sums them all. prometheus_client reads the variable when it is first imported, so it
# is set here, in the master, before any worker loads the app. Unset: a private folder, made
# now and removed when gunicorn exits (remembered in the environment, so a config reload on
# SIGHUP keeps using it).
_PRIVATE_MARK = "TERMPOOL_PRIVATE_PROMETHEUS_DIR"
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ[_PRIVATE_MARK] = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="termpool-prometheus-")
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
