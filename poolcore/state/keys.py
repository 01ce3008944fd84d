"""Every Redis key termpool writes: PREFIX, the TTLs, the fixed keys and one builder per family
(the families are listed in the package docstring, poolcore/state/__init__.py).

The Store's families read every name here as ``keys.NAME`` when they run, not as a copy taken at
import, so a test that patches one here (``keys.PREFIX``) reaches every use.
"""

from __future__ import annotations

PREFIX = "tp:"
IDEMPOTENCY_TTL = 300  # seconds a request id keeps naming its run
RECORD_TTL = 24 * 3600  # closed runs and ended jobs stay readable this long (default of the setting)
HOST_ALIVE_SECONDS = 30
NODE_TTL = 12  # a worker process counts as dead this long after its last heartbeat (every 3-5 s)

FAILURE_COUNTS = PREFIX + "count:failures"
RETRY_COUNTS = PREFIX + "count:retries"
RECENT_RUNS = PREFIX + "runs:recent"  # and in the placement script
RECENT_RUNS_KEPT = 5000  # entries of RECENT_RUNS (Store.recent_runs_kept: a test may keep fewer)
HOSTS = PREFIX + "hosts"
MONITOR = PREFIX + "monitor"
DRAINING = PREFIX + "hosts:draining"  # and in the placement script
LOST_HOSTS = PREFIX + "hosts:lost"  # and in the placement and host-lost scripts
BEAT_LOCK = PREFIX + "beat-lock"
LOCK_PATTERNS = (PREFIX + "build-lock:*", PREFIX + "pool-build-lock:*")
PREBUILD_TTL = 86400  # seconds a prebuild's report is kept
REGISTRY_USED = PREFIX + "registry:used"  # zset: last use of each tag of the pool's registry
RECENT_TTL = 3900  # seconds a minute of the rolling record (recent.py) is kept: the hour and a margin


def run_key(run_id: str) -> str:
    return f"{PREFIX}run:{run_id}"  # the Lua scripts build this one too


def run_jobs_key(run_id: str) -> str:
    return f"{PREFIX}run:{run_id}:jobs"


def run_request_key(run_id: str, key: str) -> str:
    return f"{PREFIX}run:{run_id}:request:{key}"


def run_working_key(run_id: str) -> str:
    return f"{PREFIX}run:{run_id}:working"  # the Lua scripts build this one too


def request_key(task_key: str, request_id: str, tenant: str = "") -> str:
    """A tenant's request ids are its own (another tenant's same id names a run of its own);
    tenant names hold no ':' (poolcore/tenants.py), so the two forms never meet."""
    if tenant:
        return f"{PREFIX}treq:{tenant}:{task_key}:{request_id}"
    return f"{PREFIX}req:{task_key}:{request_id}"


def tenant_live_key(tenant: str) -> str:
    return f"{PREFIX}tenant:{tenant}:live"  # a tenant's runs holding a slot; and in the Lua scripts


def host_tasks_key(host: str) -> str:
    return f"{PREFIX}host:{host}:keys"  # and in the Lua scripts


def host_live_key(host: str) -> str:
    return f"{PREFIX}host:{host}:live"  # and in the Lua scripts


def host_closing_key(host: str) -> str:
    return f"{PREFIX}host:{host}:closing"  # and in the Lua scripts


def host_workers_key(host: str) -> str:
    return f"{PREFIX}host:{host}:workers"


def images_key(host: str) -> str:
    return f"{PREFIX}images:{host}"


def image_used_key(host: str) -> str:
    return f"{PREFIX}image-used:{host}"


def image_tasks_key(host: str) -> str:
    return f"{PREFIX}image-tasks:{host}"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_done_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:done"


def episode_key(start_job: str) -> str:
    return f"{PREFIX}episode:{start_job}"


def node_key(node: str) -> str:
    return f"{PREFIX}node:{node}"


def worker_key(token: str) -> str:
    return f"{PREFIX}worker:{token}"


def worker_jobs_key(token: str) -> str:
    return f"{PREFIX}worker:{token}:jobs"


def sessions_key(run_id: str) -> str:
    return f"{PREFIX}sess:{run_id}"


def session_key(run_id: str, sid: str) -> str:
    return f"{PREFIX}sess:{run_id}:{sid}"


def warm_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm:{host}:{task_path}"


def warm_id_key(warm_id: str) -> str:
    return f"{PREFIX}warmid:{warm_id}"


def warm_claim_key(run_id: str) -> str:
    """The spare a run claimed (its entry), so a claim sent again gets the same one."""
    return f"{PREFIX}warmclaim:{run_id}"


def warm_starting_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm-starting:{host}:{task_path}"


def warm_demand_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm-demand:{host}:{task_path}"


def warm_facts_key(host: str, task_path: str) -> str:
    return f"{PREFIX}warm-facts:{host}:{task_path}"


def warm_tasks_key(host: str) -> str:
    return f"{PREFIX}warm-tasks:{host}"


def warm_counted_key(event: str) -> str:
    return f"{PREFIX}warm-counted:{event}"


def warm_counts_key(host: str) -> str:
    return f"{PREFIX}warm-counts:{host}"


def build_lock_key(host: str, image: str) -> str:
    return f"{PREFIX}build-lock:{host}:{image}"


def pool_build_lock_key(digest: str) -> str:
    return f"{PREFIX}pool-build-lock:{digest}"


def registry_pending_key(host: str) -> str:
    return f"{PREFIX}registry-pending:{host}"


def prebuild_key(batch: str) -> str:
    return f"{PREFIX}prebuild:{batch}"


def host_nodes_key(host: str) -> str:
    return f"{PREFIX}host:{host}:nodes"  # and in the placement script


def host_info_key(host: str) -> str:
    return f"{PREFIX}host:{host}:info"  # and in the placement script


def subnets_key(host: str) -> str:
    return f"{PREFIX}host:{host}:subnets"


def subnet_owners_key(host: str) -> str:
    return f"{PREFIX}host:{host}:subnet-owners"


def run_folders_key(host: str) -> str:
    return f"{PREFIX}host:{host}:run-folders"


def host_lost_key(host: str) -> str:
    return f"{PREFIX}host:{host}:lost"  # and in the host-lost script


def fork_image_key(image: str) -> str:
    return f"{PREFIX}fork-image:{image}"  # and in the fork scripts


def fork_images_key(run_id: str) -> str:
    return f"{PREFIX}fork-images:{run_id}"  # and in the fork scripts


def blob_key(blob_id: str) -> str:
    return f"{PREFIX}blob:{blob_id}"


def blob_holders_key(blob_id: str) -> str:
    return f"{PREFIX}blob:{blob_id}:holders"  # the tenants that uploaded it (docs/tenants.md)


def recent_requests_key(minute: int) -> str:
    return f"{PREFIX}recent:req:{minute}"


def recent_errors_key(minute: int) -> str:
    return f"{PREFIX}recent:err:{minute}"


def recent_failures_key(minute: int) -> str:
    return f"{PREFIX}recent:fail:{minute}"


TENANT_BUILD_LIMITS = f"{PREFIX}tenant-build-limits"  # hash: tenant -> max_builds (the facades write it)


def tenant_builds_key(tenant: str) -> str:
    return f"{PREFIX}tenant:{tenant}:builds"  # zset: build leases (job id -> expiry, ms)


def tenant_uploads_key(tenant: str) -> str:
    return f"{PREFIX}tenant:{tenant}:uploads"  # hash: blob id -> unpacked bytes, while it holds the blob
