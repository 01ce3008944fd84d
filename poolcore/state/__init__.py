"""Run, lease and job state in Redis: the one package both the facade and the workers use.

The only code that builds a Redis key or holds a Redis client: everything else asks a `Store`.
Every key termpool writes starts with PREFIX and is built by one function of keys.py (the Lua
scripts get the prefix and TTLs as arguments and build the same run and host keys):

  run:<id>                   hash: the run record (JSON for structured fields)
  run:<id>:jobs              list: job ids of the run, oldest first
  run:<id>:request:<key>     string, IDEMPOTENCY_TTL: the job a request with that Idempotency-Key
                             queued on the run (sent again, it answers that job)
  run:<id>:working           set: the run's jobs not yet ended (the idle reaper leaves a run
                             with one running); a job leaves it when it ends
  runs:recent                zset: run ids by creation time, newest RECENT_RUNS_KEPT (run viewer)
  req:<task key>:<request>   string, IDEMPOTENCY_TTL: run id of an idempotent allocate
  treq:<tenant>:<task key>:<request>  the same, of a tenant's allocate (docs/tenants.md)
  tenant:<name>:live         set: the tenant's runs holding a slot (placement counts it)
  tenant:<name>:builds       zset: its image builds in flight, job id -> lease expiry (quotas.py)
  tenant:<name>:uploads      hash: its uploaded tasks' blob ids -> unpacked bytes (quotas.py)
  tenant-build-limits        hash: tenant -> max_builds, written by the facades at start
  host:<h>:keys              hash: task_key -> live runs of that key on host h (capacity)
  host:<h>:live              zset: live run ids on host h, scored by last use (reaper)
  host:<h>:closing           set: runs released but not yet torn down
  host:<h>:workers           hash: token -> JSON facts of the worker processes of host h
  host:<h>:nodes             hash: worker node -> "<queue kind> <last beat>" (0: stopped cleanly)
  host:<h>:info              hash: what host h publishes with its heartbeat (its capacity)
  host:<h>:lost              set: runs of h marked lost (HOST_LOST) until h's reconcile closes them
  host:<h>:subnets           hash: block index of h's run-network range -> the run holding it
  host:<h>:subnet-owners     hash: run -> its blocks (subnets.py: taken and given back atomically)
  host:<h>:run-folders       zset: folders of h's runs torn down, scored by the teardown's time;
                             the reconcile removes each RUN_FOLDER_TTL later (folders.py)
  hosts                      zset: worker hosts, scored by their last heartbeat
  hosts:draining             set: hosts that take no new runs
  hosts:lost                 hash: host -> its last beat its judge saw when a process judged it
                             lost; placement passes it over until its beat in `hosts` moves
  images:<h>                 set: task paths whose images host h has built
  image-used:<h>             zset: task images (the name their build locks) by their last use on h
  image-tasks:<h>            hash: task image -> the task path it was last used for on h
  job:<id>                   hash: a job record (cancel_requested: its client cancelled it)
  job:<id>:done              list, non-empty once the job ended (wakes wait_job)
  episode:<start job>        list: an episode's job ids in chain order
  node:<name>                string, NODE_TTL: a worker process (by node name) is alive
  worker:<token>             string, NODE_TTL: one worker process (incarnation) is alive
  worker:<token>:jobs        set: jobs that worker process is running now (lost if it dies)
  fork-image:<image>         set: runs whose containers need a committed fork image
  fork-images:<run>          set: the committed fork images a run needs (its ancestors' too)
  sess:<run>                 set: the run's shell session ids
  sess:<run>:<sid>           hash: read offset and kind of a shell session
  warm:<h>:<task path>       list: pre-started warm containers (JSON entries), LPOP claims one
  warmid:<id>                string: a warm container is still wanted ("starting" with a
                             TTL, "pooled", or the run that claimed it)
  warmclaim:<run>            string: the spare entry a run claimed, so a claim sent again gets it (1 h)
  warm-starting:<h>:<task>   zset: warm ids being started, scored by when their claim lapses
  warm-demand:<h>:<task>     zset: recent resets of the task on h (run ids by time), trimmed
                             to WARM_DEMAND_WINDOW: what sizes the pool
  warm-facts:<h>:<task>      hash: task name, measured spare start seconds and idle bytes
  warm-tasks:<h>             set: task paths with a pool, starts or recent demand on h
  warm-counted:<event>       string, 1 h: a warm pool counter event was counted (counted once
                             when its write is sent again)
  warm-counts:<h>            hash: warm pool counters (claimed, missed, started, start and CPU
                             seconds, trimmed, expired, drained) for the benchmark
  build-lock:<h>:<image>     string, LOCK_TTL renewed: one build of an image per host
  pool-build-lock:<digest>   string, LOCK_TTL renewed: one build of a task environment per pool
  prebuild:<batch>           hash, PREBUILD_TTL: a pool-wide prebuild's results (builds.py)
  registry:used              zset: "<repository>:<tag>" of the pool's registry -> last push or
                             pull (registry_uses.py: what its reclaim keeps)
  registry-pending:<h>       hash: local image -> registry name, pushes host h has still to make
  beat-lock                  string, LOCK_TTL renewed: one beat scheduler per deployment
  count:failures             hash: failure code -> failed jobs (for /metrics)
  count:retries              hash: "<task>|<reason code>" -> automatic retries (for /metrics)
  recent:req:<minute>        hash, RECENT_TTL: "<tenant>|<endpoint>|<latency class>" -> requests
                             answered that minute (recent.py: the pool dashboard's last hour)
  recent:err:<minute>        hash, RECENT_TTL: "<tenant>|<code>" -> error replies that minute
  recent:fail:<minute>       hash, RECENT_TTL: "<tenant>|<code>" -> failed jobs that minute
  blob:<id>                  string (raw bytes), with a TTL: an archive or task folder on its way
  blob:<id>:holders          set, the blob's TTL: tenants that uploaded the task folder (only with tenants)
                             between the facade and a worker host (blobs.py)
  monitor                    string, a short TTL renewed: a monitor (Flower) listens for task
                             events (tasks/flower.py; poolcore/queues.py follow_monitor)

Closed runs and ended jobs expire RECORD_TTL after they end (the setting; keys.RECORD_TTL is its
default, for a Store made without it). The same Redis is Celery's broker:
its queues (``termpool.<host>.<kind>``, poolcore/queues.py) and kombu's own keys belong to kombu.
termpool only reads a queue's depth: the sum of the LLENs of its lists, one per priority step
(the list named after the queue, then one per lower step: poolcore/priorities.py queue_lists;
Store.queue_depths).

`Store` is made of one class per family of keys, each in its own module beside its Lua scripts:
runs.py (runs and their leases, the run viewer's index), jobs.py (jobs, episodes, the jobs of a
worker process), hosts.py (worker hosts and processes, images, placement, draining and lost
hosts), image_uses.py (when each host last used each task image: its image disk budget),
forks.py (forks of a live run and their committed images), subnets.py (the blocks of a host's
run-network range its runs hold), blobs.py (bytes on their way between the facade and a host),
builds.py (a pool-wide prebuild's results), registry_uses.py (the pool registry's last uses), recent.py (the last hour, per minute,
for the pool dashboard), sessions.py, warm.py (the warm pool), locks.py
(OwnedLock, the build locks of a host and of the pool, the beat lock) and
counters.py (failure and retry counts, the monitor, queue depths). keys.py holds PREFIX, the TTLs
and every key builder; codec.py how record fields are stored; connection.py where Redis is (one
Redis or a Sentinel deployment) and how every client of it, Celery's broker too, is made. Every name is re-exported here.
"""

from __future__ import annotations

import redis

from poolcore import failures
from poolcore.config import Settings
from poolcore.state import connection
from poolcore.state.blobs import BlobsState
from poolcore.state.builds import BuildsState
from poolcore.state.codec import INT_FIELDS, JSON_FIELDS
from poolcore.state.counters import CountersState
from poolcore.state.folders import FoldersState
from poolcore.state.forks import DROP_IMAGES_LUA, FORK_PLACE_LUA, ForkRefused, ForksState
from poolcore.state.hosts import HOST_FORGET_SECONDS, LOST_STATE, Allocation, CapacityError, HostsState, Placement
from poolcore.state.image_uses import ImageUsesState
from poolcore.state.jobs import BEGIN_JOB_LUA, CANCEL_JOB_LUA, FINISH_JOB_LUA, JobsState
from poolcore.state.keys import (
    BEAT_LOCK,
    DRAINING,
    FAILURE_COUNTS,
    HOST_ALIVE_SECONDS,
    HOSTS,
    IDEMPOTENCY_TTL,
    LOCK_PATTERNS,
    LOST_HOSTS,
    MONITOR,
    NODE_TTL,
    PREFIX,
    RECENT_RUNS,
    RECENT_RUNS_KEPT,
    RECORD_TTL,
    RETRY_COUNTS,
    blob_key,
    build_lock_key,
    episode_key,
    host_closing_key,
    host_info_key,
    host_live_key,
    host_lost_key,
    host_nodes_key,
    host_tasks_key,
    host_workers_key,
    image_tasks_key,
    image_used_key,
    images_key,
    job_done_key,
    job_key,
    node_key,
    pool_build_lock_key,
    prebuild_key,
    registry_pending_key,
    request_key,
    run_folders_key,
    run_jobs_key,
    run_key,
    run_request_key,
    run_working_key,
    session_key,
    sessions_key,
    subnet_owners_key,
    subnets_key,
    warm_claim_key,
    warm_counted_key,
    warm_counts_key,
    warm_demand_key,
    warm_facts_key,
    warm_id_key,
    warm_key,
    warm_starting_key,
    warm_tasks_key,
    worker_jobs_key,
    worker_key,
)
from poolcore.state.locks import LOCK_POLL, LOCK_TTL, LocksState, OwnedLock
from poolcore.state.quotas import QuotaRefused, QuotasState
from poolcore.state.recent import NO_TENANT, RecentState
from poolcore.state.registry_uses import RegistryUsesState
from poolcore.state.runs import (
    IF_STATE_LUA,
    MARK_RUN_LOST_LUA,
    NO_FAILURE,
    RELEASE_LUA,
    SET_IF_LIVE_LUA,
    STARTED_STATES,
    TRANSITION_LUA,
    USE_RUN_LUA,
    RunsState,
    UnknownRun,
    new_run_id,
)
from poolcore.state.sessions import SessionsState
from poolcore.state.subnets import RESERVED, SubnetsState
from poolcore.state.warm import WarmState

UNAVAILABLE = redis.exceptions.RedisError  # what a reader meets when Redis is away or refuses
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)  # away, not refusing
FULL = redis.exceptions.OutOfMemoryError  # at maxmemory (noeviction): reads and deletes go on, writes are refused
# A job that cannot reach Redis (an outage, a partition) or meets a full one fails with a
# retryable code of its own that names Redis, never Docker's BACKEND_UNAVAILABLE.
failures.register_unreachable(UNREACHABLE, "REDIS_UNAVAILABLE")
failures.register_codes({FULL: "BACKEND_FULL"})


class RecordLost(redis.exceptions.ConnectionError):
    """A record written moments ago is gone: Redis lost its latest writes (a failover to a
    replica they had not reached yet; docs/operations.md). Met like Redis away: 503, retryable."""


class Store(
    RunsState,
    JobsState,
    HostsState,
    WarmState,
    SessionsState,
    LocksState,
    CountersState,
    ForksState,
    SubnetsState,
    BlobsState,
    FoldersState,
    BuildsState,
    ImageUsesState,
    RegistryUsesState,
    RecentState,
    QuotasState,
):
    """Typed access to termpool's Redis keys. Safe to share between threads."""

    recent_runs_kept = RECENT_RUNS_KEPT  # how many runs a placement keeps in the recent-runs index

    def __init__(self, client: redis.Redis, record_ttl: int = RECORD_TTL):
        self._r = client
        self.record_ttl = record_ttl  # seconds closed runs and ended jobs stay (the RECORD_TTL setting)
        self._release = client.register_script(RELEASE_LUA)
        self._mark_run_lost = client.register_script(MARK_RUN_LOST_LUA)
        self._transition = client.register_script(TRANSITION_LUA)
        self._if_state = client.register_script(IF_STATE_LUA)
        self._set_if_live = client.register_script(SET_IF_LIVE_LUA)
        self._use_run = client.register_script(USE_RUN_LUA)
        self._begin_job = client.register_script(BEGIN_JOB_LUA)
        self._finish_job = client.register_script(FINISH_JOB_LUA)
        self._cancel_job = client.register_script(CANCEL_JOB_LUA)
        self._fork_place = client.register_script(FORK_PLACE_LUA)
        self._drop_images = client.register_script(DROP_IMAGES_LUA)

    @classmethod
    def connect(cls, cfg: Settings, timeout: float = 30, wait_out: bool = True) -> Store:
        """A store on its own client of the deployment's Redis: REDIS_URL's, or the primary the
        sentinels name (connection.py). How every termpool process reaches the state store.
        Its commands wait out an unreachable Redis for REDIS_OUTAGE_SECONDS; wait_out=False for
        readers that must answer at once (metrics, liveness, heartbeats: the next try is soon)."""
        outage = cfg.redis_outage_seconds if wait_out else 0.0
        return cls(connection.client(cfg, timeout, outage), cfg.record_ttl)

    @classmethod
    def from_url(cls, url: str, timeout: float = 30, record_ttl: int = RECORD_TTL) -> Store:
        """A store on one Redis by URL (tests and tools that start their own)."""
        return cls(connection.client_for_url(url, timeout), record_ttl)

    def ping(self) -> bool:
        return bool(self._r.ping())


__all__ = [
    # keys.py
    "PREFIX",
    "IDEMPOTENCY_TTL",
    "RECORD_TTL",
    "HOST_ALIVE_SECONDS",
    "NODE_TTL",
    "FAILURE_COUNTS",
    "RETRY_COUNTS",
    "RECENT_RUNS",
    "HOSTS",
    "MONITOR",
    "DRAINING",
    "LOST_HOSTS",
    "BEAT_LOCK",
    "LOCK_PATTERNS",
    "run_key",
    "run_jobs_key",
    "run_request_key",
    "run_working_key",
    "request_key",
    "host_tasks_key",
    "host_live_key",
    "host_closing_key",
    "host_workers_key",
    "images_key",
    "image_used_key",
    "image_tasks_key",
    "job_key",
    "job_done_key",
    "episode_key",
    "node_key",
    "worker_key",
    "worker_jobs_key",
    "sessions_key",
    "session_key",
    "warm_key",
    "warm_claim_key",
    "warm_id_key",
    "warm_starting_key",
    "warm_demand_key",
    "warm_facts_key",
    "warm_tasks_key",
    "warm_counted_key",
    "warm_counts_key",
    "build_lock_key",
    "pool_build_lock_key",
    "prebuild_key",
    "registry_pending_key",
    "host_nodes_key",
    "host_info_key",
    "host_lost_key",
    "subnets_key",
    "subnet_owners_key",
    "run_folders_key",
    "blob_key",
    # codec.py
    "JSON_FIELDS",
    "INT_FIELDS",
    # the families
    "NO_FAILURE",
    "STARTED_STATES",
    "UnknownRun",
    "new_run_id",
    "HOST_FORGET_SECONDS",
    "LOST_STATE",
    "CapacityError",
    "Allocation",
    "Placement",
    "LOCK_TTL",
    "LOCK_POLL",
    "OwnedLock",
    "ForkRefused",
    "RESERVED",
    "QuotaRefused",
    # here
    "RECENT_RUNS_KEPT",
    "NO_TENANT",
    "UNAVAILABLE",
    "UNREACHABLE",
    "RecordLost",
    "FULL",
    "Store",
]
