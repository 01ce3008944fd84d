"""gunicorn settings for the facade: threads, because pool calls block while their job runs."""
from termpool.config import settings

_cfg = settings()
bind = f"0.0.0.0:{_cfg.port}"
worker_class = "gthread"
workers = _cfg.web_workers
threads = _cfg.web_threads  # each blocking /reset or /evaluate holds one thread
loglevel = _cfg.log_level.lower()
accesslog = "-"
graceful_timeout = 30
