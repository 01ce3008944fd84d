"""The chaos suite: episodes through the pool API while one fault hits the service.

    python -m chaos.run                                   # every scenario, 16 episodes at 4 at once
    python -m chaos.run --scenarios baseline,kill-exec --episodes 8 --json out.json

Per scenario: start the service as `scripts/serve.sh` runs it (private ports, Redis, host
id, folders), run the episodes, inject the fault about 3 s in, measure the time until a fresh
probe episode succeeds again, let the service settle, count what it left behind, stop it and
clean up. Prints one markdown table; --json writes every detail.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from chaos import disk_hog, faults, grey, leftovers, report, sentinel
from chaos.episodes import Client, Log, episode, probe
from chaos.service import BASE_TASK, ROOT, Service, scratch_dir
from poolcore.config import QUEUE_KINDS

FAULT_AFTER = 3.0  # seconds after the episodes start
RECOVER_LIMIT = 120.0  # a service not serving a fresh episode this long after the fault "never" recovered
PROBE_TIMEOUT = 30.0
SLOW_BUILD_SECONDS = 12
REQUEST_TIMEOUT = 60.0  # client timeout of one request: a hung request counts as failed


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # what the table says
    action: str = "none"  # kill, sigstop, redis-restart, restart-stack, partition, busy-loops, sentinel-failover,
    # disk-hog (inject), grey.ACTIONS
    role: str | None = None  # the role a kill or a SIGSTOP hits
    slow_build: bool = False  # episodes use a fresh task whose image build is slow
    concurrency: int | None = None  # episodes at once, instead of --concurrency
    busy_loops: int = 0  # CPU busy loops running for the whole episode run
    env: tuple = ()  # (name, value) settings of the service in this scenario
    seconds: float = 0.0  # how long a partition or a Redis SIGSTOP lasts (0: its default)


# Recovery is timed from the start of these faults (the time down is part of it); of the
# others from their end (a kill is instant; a SIGSTOP or a partition is timed once lifted).
BOTH_IN_FLIGHT_PREFERENCE = 5.0  # s an outage waits for a reset and an evaluation at once
RECOVER_FROM_START = ("redis-restart", "restart-stack", "sentinel-failover", *grey.RECOVER_FROM_START)

SCENARIOS = {
    s.name: s
    for s in (
        Scenario("baseline", "none"),
        Scenario("kill-build", "kill -9 build worker (mid-build)", "kill", "build", slow_build=True),
        Scenario("kill-build-child", "kill -9 build prefork child (mid-build)", "kill", "build-child", slow_build=True),
        Scenario("kill-lifecycle", "kill -9 lifecycle worker", "kill", "lifecycle"),
        Scenario("kill-exec", "kill -9 exec worker", "kill", "exec"),
        Scenario("kill-eval", "kill -9 eval worker", "kill", "eval"),
        Scenario("kill-teardown", "kill -9 teardown worker", "kill", "teardown"),
        Scenario("kill-beat", "kill -9 beat (scheduler)", "kill", "beat"),
        Scenario("kill-web-master", "kill -9 gunicorn master", "kill", "web"),
        Scenario("redis-restart", "Redis SHUTDOWN NOSAVE, back after 5 s", "redis-restart"),
        *(
            Scenario(
                f"sigstop-{kind}",
                f"SIGSTOP {kind} worker and its children {faults.FREEZE_SECONDS:g} s, then SIGCONT",
                "sigstop",
                kind,
                slow_build=kind == "build",  # so the stop hits a build in flight
            )
            for kind in QUEUE_KINDS
        ),
        Scenario("restart-stack", "kill -9 whole stack + Redis, relaunch at once", "restart-stack"),
        Scenario(
            "cpu-saturated", "4 CPU busy loops all along, 8 episodes at once", "busy-loops", busy_loops=4, concurrency=8
        ),
        Scenario("redis-partition", f"DROP Redis port both ways {faults.PARTITION_SECONDS:g} s", "partition"),
        *(
            Scenario(f"redis-partition-{s}", f"DROP Redis port both ways {s} s", "partition", seconds=s)
            for s in (5, 30)
        ),
        Scenario("redis-sigstop", "SIGSTOP Redis 10 s, then SIGCONT", "redis-sigstop", seconds=10),
        Scenario("sentinel-failover", "kill -9 Redis primary (Sentinel: replica + 3 sentinels)", "sentinel-failover"),
        *(Scenario(name, fault, action) for name, fault, action in grey.SCENARIOS),
        Scenario(
            "disk-limit",
            f"one extra run writes {2 * disk_hog.LIMIT_MB} MiB past CONTAINER_DISK_LIMIT={disk_hog.LIMIT_MB}m",
            "disk-hog",
            env=disk_hog.ENV,
        ),
    )
}


def inject(scenario: Scenario, service: Service, undo: faults.Undo, daemon=None, prefer_both: float = 0.0) -> dict:
    if scenario.action in ("none", "busy-loops"):  # the busy loops run around the episodes
        return {"action": scenario.action}
    if scenario.action in ("partition", "redis-sigstop", *grey.DOCKER_RESTARTS):  # aimed at resets and evaluations
        aimed = faults.wait_reset_and_eval(service.store(), prefer_both)
        return {**aimed, "hit_at": time.monotonic(), **inject_now(scenario, service, undo, daemon)}
    return inject_now(scenario, service, undo, daemon)


def inject_now(scenario: Scenario, service: Service, undo: faults.Undo, daemon=None) -> dict:
    if scenario.action in grey.ACTIONS:
        return grey.inject(scenario.action, service, daemon)
    if scenario.action == "redis-restart":
        return faults.restart_redis(service)
    if scenario.action == "restart-stack":
        return faults.restart_stack(service)
    if scenario.action == "partition":
        return faults.partition_redis(service, undo, scenario.seconds or faults.PARTITION_SECONDS)
    if scenario.action == "redis-sigstop":
        return faults.freeze_redis(service, undo, scenario.seconds)
    if scenario.action == "sentinel-failover":
        return sentinel.fail_over(service)
    if scenario.action == "disk-hog":
        return disk_hog.write_past_limit(service)
    app = service.celery()
    if scenario.action == "sigstop":
        return faults.freeze_role(service, scenario.role, app, undo)
    if scenario.role == "build-child":
        return faults.kill_build_child(service, app)
    return faults.kill_role(service, scenario.role, app)


def measure_recovery(service: Service, t0: float, result: dict) -> None:
    """Seconds from the fault until the stack is whole again (every Procfile process running)
    and a fresh probe episode succeeds; None when that never happens (within RECOVER_LIMIT, or
    at once when the service command itself has exited)."""
    attempts = 0
    while time.monotonic() - t0 < RECOVER_LIMIT:
        attempts += 1
        missing = service.missing_roles()
        ok, why = probe(service.url, BASE_TASK, PROBE_TIMEOUT) if not missing else (False, f"not running: {missing}")
        if ok:
            result.update(recover_s=round(time.monotonic() - t0, 1), probe_attempts=attempts)
            return
        result["last_probe_error"] = why
        if not service.alive():
            result.update(recover_s=None, probe_attempts=attempts, service_exited=True)
            return
        time.sleep(1)
    result.update(recover_s=None, probe_attempts=attempts)


def run_scenario(
    scenario: Scenario,
    episodes: int,
    concurrency: int,
    logs: Path,
    request_timeout: float = REQUEST_TIMEOUT,
    seed_client: bool = False,
) -> dict:
    """Start the service, run the episodes with the fault, measure; the service is stopped and
    cleaned up whatever happens (a scenario that could not run says why under "error")."""
    try:
        with grey.backdrop(scenario.action) as (env, daemon):
            # sentinel-failover: Redis is a Sentinel deployment (chaos/sentinel.py), not serve.sh's own
            kind = sentinel.SentinelService if scenario.action == "sentinel-failover" else Service
            service = kind(scratch_dir(), {**env, **dict(scenario.env)})
            return _run_scenario(scenario, service, daemon, episodes, concurrency, logs, request_timeout, seed_client)
    except Exception as exc:  # what the scenario runs on (a second Docker daemon) could not be set up
        return {"scenario": scenario.name, "fault": scenario.fault, "error": f"{type(exc).__name__}: {exc}"}


def _run_scenario(
    scenario: Scenario,
    service: Service,
    daemon,
    episodes: int,
    concurrency: int,
    logs: Path,
    request_timeout: float,
    seed_client: bool = False,
) -> dict:
    concurrency = scenario.concurrency or concurrency
    result: dict = {
        "scenario": scenario.name,
        "fault": scenario.fault,
        "episodes": episodes,
        "concurrency": concurrency,
        "client": "seed" if seed_client else "router",
        "host_id": service.host_id,
    }
    started = time.monotonic()
    try:
        if scenario.action == "partition":
            faults.check_partition(service)  # no iptables: an error, not a run without its fault
        service.start()
        result["startup_s"] = round(time.monotonic() - started, 1)
        ok, why = probe(service.url, BASE_TASK, 120)  # also builds the base task's image on this host
        if not ok:
            raise RuntimeError(f"warm-up episode failed: {why}")
        task = service.slow_task(SLOW_BUILD_SECONDS) if scenario.slow_build else BASE_TASK
        result.update(
            run_episodes(scenario, service, task, episodes, concurrency, request_timeout, daemon, seed_client)
        )
        result["settle_s"] = leftovers.settle(service)
        result["not_running_after"] = service.missing_roles() if service.alive() else ["serve.sh"]
        result["leftovers"] = leftovers.measure(service)
    except Exception as exc:  # the harness's own failure: reported, and the next scenario still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        finish(service, result, logs, started)
    return result


def run_episodes(
    scenario: Scenario,
    service: Service,
    task: str,
    episodes: int,
    concurrency: int,
    request_timeout: float,
    daemon=None,
    seed_client: bool = False,
) -> dict:
    """The episodes, `concurrency` at once, and the fault FAULT_AFTER s in, then recovery.
    seed_client: the episodes retry as the seed's client does (episodes.SeedRetrying)."""
    log = Log()
    local = threading.local()
    clients: list[Client] = []
    fault_info: dict = {}
    recovery: dict = {}
    marks: list = []  # (name, monotonic) of the fault's end, when it has one
    undo = faults.Undo()
    gave_up = threading.Event()  # the service will not recover: stop waiting for a lease

    def keep_trying(waited: float) -> bool:
        return waited < RECOVER_LIMIT and not gave_up.is_set()

    def one(index: int) -> dict:
        if not hasattr(local, "client"):
            local.client = Client(service.url, log, request_timeout)
            clients.append(local.client)
        key = f"chaos-{index % concurrency}"
        record = episode(local.client, key, task, keep_trying=keep_trying, seed=seed_client)
        log.episode(record)
        return record

    def fault_then_recover() -> None:
        time.sleep(FAULT_AFTER)
        service.snapshot()
        at = time.monotonic()
        try:
            # Wait for a reset beside the evaluation only when enough episodes are left to bring one.
            prefer_both = BOTH_IN_FLIGHT_PREFERENCE if episodes >= 4 * concurrency else 0.0
            fault_info.update(inject(scenario, service, undo, daemon, prefer_both))
        except Exception as exc:
            fault_info["error"] = f"{type(exc).__name__}: {exc}"
        at = fault_info.pop("hit_at", at)  # a fault that measures first says when it hit (monotonic)
        t0 = at if scenario.action in RECOVER_FROM_START else time.monotonic()
        fault_info["at_s"] = round(t0 - begin, 1)
        if "mark_at" in fault_info:  # the fault's end, monotonic: kept as seconds into the run
            mark_at = fault_info.pop("mark_at")
            marks.append((fault_info["mark"], mark_at))
            fault_info["mark_at_s"] = round(mark_at - begin, 1)
        try:
            measure_recovery(service, t0, recovery)
        except Exception as exc:  # the harness's own failure: recorded, and the episodes stop waiting
            recovery["recover_error"] = f"{type(exc).__name__}: {exc}"
        if recovery.get("recover_s") is None:
            gave_up.set()

    chaos_thread = threading.Thread(target=fault_then_recover, daemon=True)
    try:
        with faults.busy_loops(scenario.busy_loops) as loops:
            if loops:
                fault_info["busy_loop_pids"] = loops
            begin = time.monotonic()
            chaos_thread.start()
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                list(pool.map(one, range(episodes)))
            episodes_s = round(time.monotonic() - begin, 1)
            chaos_thread.join()
    finally:
        undo.close()  # a fault cut short (the harness failed) is lifted here
    for client in clients:
        client.close()
    return {"episodes_s": episodes_s, "fault_detail": fault_info, **recovery, **summarize(log, marks)}


def failures_after(log: Log, marks) -> dict:
    """Failed requests (every try, tool calls too) by code, and by code (step) after the
    fault's end when it has one: `failed_after_<mark>_by_code`, with one message of each."""
    out = {"request_failures_by_code": dict(collections.Counter(f[2] for f in log.failures).most_common())}
    for name, at in marks:
        after = [(ended, f"{code} ({step})", detail) for ended, step, code, detail in log.failures if ended >= at]
        out.update(
            failed_after=name,
            **{f"failed_after_{name}_by_code": dict(collections.Counter(key for _, key, _ in after).most_common())},
            failed_after_examples={key: detail for _, key, detail in reversed(after)},  # the first message of each
            # a detector's lag right after the end, or failures that go on: the last one tells
            last_failure_after_s=round(after[-1][0] - at, 1) if after else None,
        )
    return out


def summarize(log: Log, marks=()) -> dict:
    failed = collections.Counter(f"{e['code']} ({e['step']})" for e in log.episodes if not e["ok"])
    longest = max(log.requests, key=lambda r: r[1], default=(None, 0.0, True))
    examples = {}
    for e in log.episodes:
        if not e["ok"]:
            examples.setdefault(f"{e['code']} ({e['step']})", e["detail"])
    return {
        "episodes_ok": sum(1 for e in log.episodes if e["ok"]),
        "episodes_whole": sum(1 for e in log.episodes if e.get("whole")),
        "episodes_whole_without_retries": sum(1 for e in log.episodes if e.get("whole_without_retries")),
        "failed_by_code": dict(failed.most_common()),
        "failure_examples": examples,
        "lost_tool_calls": sum(e["lost_tool_calls"] for e in log.episodes),
        "runs_lost": sum(1 for e in log.episodes if not e["ok"] and e["step"] != "allocate"),
        "refused": sum(1 for e in log.episodes if not e["ok"] and e["step"] == "allocate"),
        "allocate_retries": sum(e["allocate_retries"] for e in log.episodes),
        "step_retries": sum(e.get("step_retries", 0) for e in log.episodes),
        "requests": len(log.requests),
        "longest_request_s": longest[1],
        "longest_request_step": longest[0],
        "requests_over_20s": sum(1 for r in log.requests if r[1] > 20),
        **failures_after(log, marks),
    }


def finish(service: Service, result: dict, logs: Path, started: float) -> None:
    left = result.setdefault("leftovers", {})
    left["processes"] = service.stop()
    service.stop_redis()
    left["packet_rules"] = leftovers.packet_rules(service)
    left["temp_files"] = leftovers.temp_files(service)
    result["leftover_count"] = leftovers.count(left)
    keep = logs / result["scenario"]
    keep.mkdir(parents=True, exist_ok=True)
    for path in [service.log_path, *sorted(service.workdir.glob("logs/*"))]:
        if path.is_file():
            shutil.copy(path, keep / path.name)
    result["harness_cleanup"] = leftovers.cleanup(service)
    result["total_s"] = round(time.monotonic() - started, 1)


def machine() -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {"commit": commit, "cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT,
        help="client timeout of one request, seconds (a request that hits it counts as failed)",
    )
    parser.add_argument(
        "--client",
        choices=("router", "seed"),
        default="router",
        help="how episodes retry: a router that resends retryable idempotent steps (default), or the"
        " seed's client (a fixed number of tries per call: episodes.SEED_RETRIES)",
    )
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--markdown", type=Path, help="write the table to this file too")
    parser.add_argument("--logs", type=Path, help="keep each scenario's service log here (default: a temp folder)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    logs = args.logs or scratch_dir()
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "request_timeout_s": args.request_timeout,
        "client": args.client,
        "fault_after_s": FAULT_AFTER,
        "recover_limit_s": RECOVER_LIMIT,
        **machine(),
    }
    results = []
    failed_to_run = 0
    for name in names:
        print(f"[chaos] {name} ...", file=sys.stderr, flush=True)
        result = run_scenario(
            SCENARIOS[name], args.episodes, args.concurrency, logs, args.request_timeout, args.client == "seed"
        )
        results.append(result)
        failed_to_run += "error" in result
        print(f"[chaos] {name}: {report.one_line(result)}", file=sys.stderr, flush=True)
        if args.json:  # written after every scenario: a long run that dies keeps what it measured
            args.json.write_text(json.dumps({"meta": meta, "scenarios": results}, indent=2) + "\n")
    table = report.table(results)
    print(table)
    print(f"\nservice logs: {logs}", file=sys.stderr)
    if args.markdown:
        args.markdown.write_text(report.document(meta, table))
    return 2 if failed_to_run else 0


if __name__ == "__main__":
    sys.exit(main())
