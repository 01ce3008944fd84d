"""A Redis timeout met inside any kind of job is recorded as Redis's (REDIS_UNAVAILABLE, its
text naming Redis), never as Docker's. Each job body runs here in-process against a real
Redis, through a store whose reads time out as they do when Redis is partitioned away; the
job's own start and end still reach Redis, as they do once it is back."""

from __future__ import annotations

import pytest
import redis

from poolcore.state import Store

# What the job wrapper itself writes (its start and end): these reach Redis.
WRAPPER_CALLS = {"begin_job", "job_finished", "job_left", "job_retrying", "set_state_if_live", "get_job"}
TIMEOUT = "Timeout reading from socket"


class PartitionedStore(Store):
    """The job body's first Redis command times out, as one to a partitioned Redis does once
    the client's own wait (REDIS_OUTAGE_SECONDS) has passed; then the partition heals, so the
    failure handlers and the job's end reach Redis, as they do once it is back."""

    healed = False

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name.startswith("_") or name in WRAPPER_CALLS or not callable(attr) or self.healed:
            return attr

        def timed_out(*args, **kwargs):
            self.healed = True
            raise redis.exceptions.TimeoutError(TIMEOUT)

        return timed_out


KINDS = [
    "ensure_image",
    "start_run",
    "exec_tool",
    "evaluate",
    "run_command",
    "put_archive",
    "get_archive",
    "fork_run",
    "release_run",
]


def _jobs():
    from tasks import archive_jobs, command_jobs, episode, fork_jobs, run_jobs

    return {
        "ensure_image": (run_jobs, run_jobs.ensure_image, {}),
        "start_run": (run_jobs, run_jobs.start_run, {}),
        "exec_tool": (run_jobs, run_jobs.exec_tool, {"tool_call": {"name": "shell_exec", "arguments": {}}}),
        "evaluate": (run_jobs, run_jobs.evaluate, {}),
        "close_run": (run_jobs, run_jobs.close_run, {}),
        "run_command": (command_jobs, command_jobs.run_command, {"command": {"command": "true"}}),
        "put_archive": (archive_jobs, archive_jobs.put_archive, {"path": "/tmp", "ttl": 60}),
        "get_archive": (archive_jobs, archive_jobs.get_archive, {"path": "/tmp", "max_bytes": 1 << 20, "ttl": 60}),
        "fork_run": (fork_jobs, fork_jobs.fork_run, {"children": []}),
        "release_run": (episode, episode.release_run, {}),
    }


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS)
def test_a_redis_timeout_inside_a_job_is_redis_s(redis_server, monkeypatch, kind):
    from tasks import job_context, run_jobs

    module, task, extra = _jobs()[kind]
    real = Store(redis_server)
    partitioned = PartitionedStore(redis_server)
    for mod in {job_context, run_jobs, module}:
        monkeypatch.setattr(mod, "store", lambda: partitioned)
    redis_server.flushdb()  # a job is recorded once: each kind's job-1 is a new one
    real.create_job("job-1", "run-1", kind)
    with pytest.raises(redis.exceptions.TimeoutError):
        task.run(host="h1", run_id="run-1", job_id="job-1", **extra)
    job = real.get_job("job-1")
    assert (job["state"], job["code"], job["retryable"]) == ("failed", "REDIS_UNAVAILABLE", True), job
    assert job["error"].startswith(f"Redis is unreachable: TimeoutError: {TIMEOUT}"), job["error"]
    assert "Docker" not in job["error"]


@pytest.mark.unit
def test_a_teardown_waits_out_a_redis_timeout(redis_server, monkeypatch):
    """A close's Redis calls are tried again until Redis answers: it finishes, not fails."""
    from tasks import job_context, run_jobs

    real, partitioned = Store(redis_server), PartitionedStore(redis_server)
    for mod in (job_context, run_jobs):
        monkeypatch.setattr(mod, "store", lambda: partitioned)
    redis_server.flushdb()
    real.create_job("job-1", "run-1", "close_run")
    run_jobs.close_run.run(host="h1", run_id="run-1", job_id="job-1")
    assert partitioned.healed and real.get_job("job-1")["state"] == "succeeded"
