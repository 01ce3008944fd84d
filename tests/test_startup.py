"""Start-up and restarts through the real serve path (scripts/serve.sh: every Procfile process
under supervisord, its own Redis with an append-only file): work sent the moment /healthz
first answers succeeds, on fresh starts and after kill -9 of the whole stack; /readyz and the
"ready" line follow once the workers serve."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from chaos import leftovers
from chaos.service import BASE_TASK, Service, scratch_dir
from termpool.client import HostLost, Pool, TermpoolError, write_file_call
from tests.conftest import run_containers, wait_for

AT_ONCE = 4
FRESH_STARTS = 5
SOLUTION = write_file_call("/app/hello.txt", "Hello, world!\n")


def episode(url: str, index: int) -> str:
    """One whole episode as a router sends it, no retries: '' when it succeeded, else why not."""
    with Pool(url, timeout=300, job_timeout=300, retries=0) as pool:
        try:
            lease = pool.allocate(BASE_TASK)
            lease.reset(BASE_TASK, instruction=f"startup episode {index}")
            assert "hi" in str(lease.exec("echo hi", timeout=20))
            lease.tool(SOLUTION["name"], **SOLUTION["arguments"])
            score = lease.evaluate().score
            lease.close()
        except TermpoolError as exc:
            return f"episode {index}: {exc!r}"
    return "" if score == 1.0 else f"episode {index}: score {score}"


def episodes_at_once(url: str) -> list[str]:
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return [why for why in pool.map(lambda i: episode(url, i), range(AT_ONCE)) if why]


@pytest.fixture
def service(base_image):
    """serve.sh on private ports, a private Redis and host id; stopped and cleaned after."""
    s = Service(scratch_dir())
    yield s
    s.stop()
    s.stop_redis()
    leftovers.cleanup(s)


def ready_line(s: Service) -> bool:
    return "termpool: ready on port" in s.log_path.read_text(errors="replace")


def test_work_sent_at_the_first_healthz_succeeds_on_fresh_starts(base_image):
    for start in range(FRESH_STARTS):
        s = Service(scratch_dir())  # fresh: an empty Redis, a new host id
        try:
            s.launch()
            waited = s.wait_healthy()
            failed = episodes_at_once(s.url)
            assert not failed, f"start {start} (healthz after {waited:.1f} s): {failed}; log {s.log_path}"
            assert wait_for(lambda s=s: ready_line(s), 60), f"no ready line in {s.log_path}"
            assert s.client.ready()
        finally:
            s.stop()
            s.stop_redis()
            leftovers.cleanup(s)


def test_readyz_answers_503_until_a_host_serves(service):
    service.launch()
    service.wait_healthy()
    first = service.client.request("GET", "/readyz")
    if first.status_code == 503:  # usually: the workers have not beaten twice yet
        assert first.json()["code"] == "NOT_READY" and first.json()["retryable"] is True
        assert "host" in first.json()["error"] or "heartbeat" in first.json()["error"]
    assert wait_for(service.client.ready, 120)
    assert service.client.request("GET", "/readyz").json() == {"ok": True}


def test_a_restart_after_kill_9_of_everything_serves_at_once(service, docker_client):
    """A crash or power loss: kill -9 of every process, Redis too, then the same host id and
    Redis's append-only file. The old incarnation's records never make the new one look lost;
    runs that were live go on (their containers are dockerd's), and a run whose container died
    with the old incarnation is lost (HOST_LOST) once the new workers have reconciled."""
    service.start()
    assert not episodes_at_once(service.url)
    with Pool(service.url, timeout=300, job_timeout=300, retries=0) as pool:
        survivor = pool.allocate(BASE_TASK)
        survivor.reset(BASE_TASK, instruction="lives through a restart")
        doomed = pool.allocate(BASE_TASK)
        doomed.reset(BASE_TASK, instruction="dies with the host")
        [container] = run_containers(docker_client, service.store(), doomed.id)
        time.sleep(1.5)  # the append-only file is fsynced every second
        service.kill_everything()
        container.kill()  # the crash took this run's container too
        service.launch()
        service.wait_healthy()
        failed = episodes_at_once(service.url)
        assert not failed, f"after the restart: {failed}; log {service.log_path}"
        assert "restart-ok" in str(survivor.exec("echo restart-ok", timeout=20))
        assert survivor.close() is True
        assert wait_for(lambda: pool.run(doomed.id).info()["state"] == "lost", 60)
        with pytest.raises(HostLost):
            doomed.exec("echo gone", timeout=20)
        doomed.close()
    assert wait_for(lambda: ready_line(service), 60)
