"""Where Redis is, and the one place its clients are made: the state store of every process
(facade, workers, a worker's heartbeat thread, the liveness watches, Flower, the CLI) and
Celery's broker all come from here, so a Sentinel deployment reaches each of them.

REDIS_URL names one Redis. REDIS_SENTINELS names the sentinels that watch a primary and its
replicas instead (REDIS_SENTINEL_MASTER: the name they watch it by). redis-py's Sentinel client
asks them for the primary's address whenever it opens a connection; a connection left on a
primary that was demoted meets READONLY, which redis-py turns into a ConnectionError (and a new
look-up next time). kombu's `sentinel://` transport does the same for the broker. So during a
failover a command meets ConnectionError or TimeoutError, as when the one Redis is away, and
OutageRetry sends it again until REDIS_OUTAGE_SECONDS have passed: the caller only waits. Past
that the facade answers 503 REDIS_UNAVAILABLE (retryable).

The Lua scripts survive a failover: redis-py's Script sends EVALSHA and, on NOSCRIPT from a
server that never saw the script (the promoted replica), loads it and sends it again.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import quote, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from poolcore.config import Settings

log = logging.getLogger(__name__)

SENTINEL_TIMEOUT = 2.0  # seconds for one question to one sentinel: a silent one costs no more


class OutageRetry(Retry):
    """redis-py's retry bounded by time instead of by count: a command meeting a connection
    error or a timeout is sent again, with jittered backoff, until `window` seconds have passed
    since its first failure, so a restart, a partition or a Sentinel failover shorter than that
    costs its caller only the wait. (A command whose reply was lost may run twice; termpool's
    writes are state transitions and sets that a second run leaves as they are.)"""

    def __init__(self, window: float):
        super().__init__(ExponentialWithJitterBackoff(base=0.1, cap=1.0), retries=-1)
        self.window = window

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        first_failure: list[float] = []

        def within_window(error: Exception) -> bool:
            if is_retryable is not None and not is_retryable(error):
                return False
            first_failure[:] = first_failure or [time.monotonic()]
            if time.monotonic() - first_failure[0] < self.window:
                log.warning("Redis not reached (%s); trying again", error)
                return True
            return False

        return super().call_with_retry(do, fail, within_window, with_failure_count)


class PrimaryConnection(SentinelManagedConnection):
    """A connection to the primary the sentinels name now, asked again at every connect. redis-py
    (8.1) retries a failed command by reconnecting to the address the connection had, so with
    OutageRetry a call caught by a failover would knock on the dead primary for the whole window."""

    def connect_check_health(self, *args, **kwargs):
        self.host, self.port = self.connection_pool.get_master_address()
        return super().connect_check_health(*args, **kwargs)


def client_options(timeout: float, outage: float = 0.0) -> dict:
    """How every state-store connection behaves. The socket timeout must exceed wait_job's polls
    of a few seconds (readers that never block, like /metrics, pass a short one). `outage`:
    seconds a command waits for an unreachable Redis (REDIS_OUTAGE_SECONDS; 0: none)."""
    options = {
        "decode_responses": True,
        "health_check_interval": 30,
        "socket_timeout": timeout,
        "socket_connect_timeout": min(5, timeout),
    }
    if outage > 0:
        options["retry"] = OutageRetry(outage)
    return options


def client(cfg: Settings, timeout: float = 30, outage: float = 0.0) -> redis.Redis:
    """A client of the primary: REDIS_URL's Redis, or the one the sentinels name now. Commands
    wait out an unreachable Redis for `outage` seconds (the long-lived stores of the facade and
    the workers pass REDIS_OUTAGE_SECONDS; readers that must not block pass nothing)."""
    if not cfg.redis_sentinels:
        return client_for_url(cfg.redis_url, timeout, outage)
    sentinel = Sentinel(
        list(cfg.redis_sentinels),
        sentinel_kwargs={
            "password": cfg.redis_sentinel_password or None,
            "socket_timeout": min(SENTINEL_TIMEOUT, timeout),
            "socket_connect_timeout": min(SENTINEL_TIMEOUT, timeout),
        },
    )
    return sentinel.master_for(
        cfg.redis_sentinel_master,
        db=cfg.redis_db,
        password=cfg.redis_password or None,
        connection_class=PrimaryConnection,
        **client_options(timeout, outage),
    )


def client_for_url(url: str, timeout: float = 30, outage: float = 0.0) -> redis.Redis:
    """A client of one Redis by URL (tests and tools that start their own)."""
    return redis.Redis.from_url(url, **client_options(timeout, outage))


def binary_client(client: redis.Redis) -> redis.Redis:
    """A client of the same Redis (same connection settings, Sentinel included) that returns
    bytes: a new pool made from the public connection settings of `client`'s pool."""
    pool = client.connection_pool
    options = {**pool.connection_kwargs, "decode_responses": False, "connection_class": pool.connection_class}
    if isinstance(pool, SentinelConnectionPool):  # asks the sentinels for the primary, as `client` does
        return redis.Redis(connection_pool=SentinelConnectionPool(pool.service_name, pool.sentinel_manager, **options))
    return redis.Redis(connection_pool=redis.ConnectionPool(**options))


def broker_url(cfg: Settings) -> str:
    """Celery's broker URL: REDIS_URL, or one `sentinel://` URL per sentinel joined by `;` (the
    primary's password and database ride in each, as kombu reads them)."""
    if not cfg.redis_sentinels:
        return cfg.redis_url
    auth = f":{quote(cfg.redis_password, safe='')}@" if cfg.redis_password else ""
    return ";".join(f"sentinel://{auth}{_netloc(host, port)}/{cfg.redis_db}" for host, port in cfg.redis_sentinels)


def broker_transport_options(cfg: Settings) -> dict:
    """What kombu's sentinel transport needs besides the URL: the primary's name and the
    sentinels' own password. Nothing for a plain Redis."""
    if not cfg.redis_sentinels:
        return {}
    options: dict = {"master_name": cfg.redis_sentinel_master}
    if cfg.redis_sentinel_password:
        options["sentinel_kwargs"] = {"password": cfg.redis_sentinel_password}
    return options


def endpoints(cfg: Settings) -> list[tuple[str, int]]:
    """The (host, port) of every Redis server termpool talks to, for the containment rules: the
    one Redis (none for a unix socket), or the sentinels and the primary and replicas they
    know now (a node that joins later is not among them: CONTAINMENT_BLOCK covers it)."""
    if not cfg.redis_sentinels:
        url = urlsplit(cfg.redis_url)
        return [(url.hostname or "localhost", url.port or 6379)] if url.scheme in ("redis", "rediss") else []
    found = list(cfg.redis_sentinels)
    sentinel = client(cfg, timeout=SENTINEL_TIMEOUT).connection_pool.sentinel_manager
    name = cfg.redis_sentinel_master
    try:
        found += [sentinel.discover_master(name), *sentinel.discover_slaves(name)]
    except redis.RedisError as exc:  # no sentinel answers: the sentinels alone
        log.warning("could not ask the sentinels for the Redis servers of %r: %s", name, exc)
    return list(dict.fromkeys((host, int(port)) for host, port in found))


def describe(cfg: Settings) -> str:
    """Where the state store is, for error messages."""
    if not cfg.redis_sentinels:
        return f"Redis at {cfg.redis_url}"
    sentinels = ",".join(_netloc(host, port) for host, port in cfg.redis_sentinels)
    return f"the Redis primary {cfg.redis_sentinel_master!r} of sentinels {sentinels}"


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
