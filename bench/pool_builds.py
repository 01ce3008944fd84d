"""One build per pool (issue 37), measured: two Docker daemons standing for two worker hosts, a
third that joins later, a cold private registry, and the example tasks plus the Harbor fixtures.

    python -m bench.pool_builds [--quick] [--warm-repeats 2] [--out bench/results]

Host A is the machine's dockerd, hosts B and C second daemons (devstack/second_docker.py), all
started before any clock runs. In this order:

1. single: one host (A, no registry) builds the whole dataset with `dataset prebuild` (its one
   build worker, BUILD_CONCURRENCY builds at a time): the floor the pool is compared with.
2. pool: a new copy of the dataset (a new marker: new digests, a cold registry), A and B
   serving with the registry on, `dataset prebuild` (not --hosts all): builds spread over both
   hosts' build queues and pushed. Builds done in the pool: distinct agent-image ids over both
   hosts (a build makes a new id; a pull keeps the builder's), against distinct content digests.
3. resets: on A, then on B (the other host drained), every task reset once (its first reset on
   that host: its image there already, or pulled now from the registry) and --warm-repeats times
   more (warm: the image present). Each reset through the pool API, measured alone (the previous
   run's teardown waited out).
4. join: C's workers start (the clock starts), it serves, `dataset prebuild --hosts all` pulls
   every task onto it; then its first and warm resets (A and B drained).
Registry storage and each daemon's image disk before and after. Everything the run made (images,
containers, daemons, the registry, its stacks' processes) is removed on every exit path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench import pool_parts as parts
from bench.output import emit
from bench.pool_report import table
from devstack import ROOT, Stack
from devstack.second_docker import SecondDocker
from environments.compose_config import client_image
from environments.docker_client import docker_client
from poolcore.config import load_settings
from poolcore.state import Store
from termpool.client import Pool

PREBUILD_TIMEOUT = 1800
STACK_ENV = {"WARM_POOL_SIZE": "0"}  # every reset a real start, never a spare's claim


def log(message: str) -> None:
    print(f"[bench.pool_builds {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pool_builds", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(parts.QUICK_TASKS)}; 1 warm reset")
    p.add_argument("--warm-repeats", type=int, help="warm resets per task and host (default 2, quick 1)")
    p.add_argument(
        "--build-seconds",
        type=float,
        default=0,
        help="each environment's build also sleeps this long (a real build's downloads: time, no CPU)",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    args.warm_repeats = args.warm_repeats or (1 if args.quick else 2)
    return args


def terminate(signum, frame):
    raise SystemExit(128 + signum)  # so every finally below runs (removal of what the run made)


class Bench:
    """What a run made, for its removal: the temp folder, the registry, the daemons, the stacks."""

    def __init__(self, args):
        self.args = args
        self.suffix = "pb" + uuid.uuid4().hex[:6]
        self.tmp = Path(tempfile.mkdtemp(prefix="termpool-poolbench-"))
        self.registry = parts.PrivateRegistry(self.tmp / "registry")
        self.daemons: dict[str, SecondDocker] = {}  # "B", "C"
        self.stacks: list[Stack] = []
        self.clients = {"A": docker_client()}
        self.hosts: dict[str, str] = {}  # "A" / "B" / "C" -> the pool's host id now
        self.host_ids: list[str] = []  # every host id the run's stacks had (their containers go)
        self.tasks = parts.source_tasks(args.quick)
        self.failures: list[str] = []
        self.task_paths: dict[str, str] = {}  # task -> its path under the stack's DATASET_DIR
        self.left: list[str] = []

    @property
    def marks(self) -> tuple[str, ...]:
        return (self.suffix, self.registry.address + "/")

    def set_up(self) -> None:
        subprocess.run(["bash", str(ROOT / "tests" / "base_image.sh")], check=True, capture_output=True)
        self.registry.start()
        for name in ("B", "C"):
            daemon = SecondDocker()
            log(f"starting dockerd {name} ({daemon.name})")
            self.daemons[name] = daemon
            daemon.start()
            parts.load_base(daemon)
            self.clients[name] = daemon.client()

    def stack(self, env: dict) -> Stack:
        stack = Stack(env={**STACK_ENV, **env})
        self.stacks.append(stack)
        stack.start()
        return stack

    def host(self, letter: str, host_id: str) -> str:
        self.hosts[letter] = host_id
        self.host_ids.append(host_id)
        return host_id

    def stop_stack(self, stack: Stack) -> None:
        stack.stop()
        self.stacks.remove(stack)
        shutil.rmtree(stack.workdir, ignore_errors=True)

    def tear_down(self) -> None:
        """Everything the run started, whatever happened (a step that fails is reported and the
        next one still runs); after a failure the stacks' logs stay."""
        steps = [functools.partial(self.stop_own_stack, stack) for stack in self.stacks]
        steps.append(lambda: self.left.extend(parts.remove_run_objects(self.clients["A"], self.host_ids, self.marks)))
        for name, daemon in self.daemons.items():
            if name in self.clients:
                steps.append(self.clients[name].close)
            steps.append(daemon.stop)  # its containers and images go with its data root
        steps += [self.registry.stop, functools.partial(shutil.rmtree, self.tmp, ignore_errors=True)]
        for step in steps:
            try:
                step()
            except Exception as exc:
                self.left.append(f"tear-down: {type(exc).__name__}: {exc}")

    def stop_own_stack(self, stack: Stack) -> None:
        stack.stop()
        if self.failures:
            log(f"the stack's logs stay in {stack.workdir}")
        else:
            shutil.rmtree(stack.workdir, ignore_errors=True)


# ---- measuring ----------------------------------------------------------------------------------
def prebuild(stack: Stack, where: str, directory: Path | None = None) -> dict:
    """`flask --app app dataset prebuild --hosts <where> --json` against the stack: its wall time
    (the CLI's start and its wait for the hosts' heartbeats included) and its report."""
    argv = [sys.executable, "-m", "flask", "--app", "app", "dataset", "prebuild", "--hosts", where, "--json"]
    argv += [str(directory)] if directory else []
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=PREBUILD_TIMEOUT)
    seconds = time.monotonic() - started
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"prebuild --hosts {where} exited {done.returncode}: {done.stderr[-2000:]}") from None
    rows = [{k: row[k] for k in ("task", "host", "status", "seconds", "error")} for row in report["tasks"]]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("built", "pulled", "present", "failed")}
    return {"wall_s": round(seconds, 1), "exit": done.returncode, "counts": counts, "rows": rows}


def image_names(names: list[str], stack: Stack) -> dict[str, str]:
    cfg = load_settings(stack.env)
    return {name: client_image(name, cfg) for name in names}


def builds_done(bench: Bench, images: dict[str, str], letters: list[str]) -> dict:
    """Builds the pool did, read off the daemons: each build makes an image id of its own and a
    pull keeps the builder's, so distinct agent-image ids over the hosts = builds; distinct
    content digests = distinct environments (the target)."""
    found = {letter: parts.client_ids(bench.clients[letter], images) for letter in letters}
    ids = {info["id"] for per_host in found.values() for info in per_host.values()}
    digests = {info["content"] for per_host in found.values() for info in per_host.values()}
    missing = {letter: sorted(set(images) - set(per_host)) for letter, per_host in found.items()}
    return {
        "builds": len(ids),
        "distinct_environments": len(digests),
        "missing": {k: v for k, v in missing.items() if v},
        "by_task": {
            task: {letter: found[letter].get(task, {}).get("id", "")[7:19] for letter in letters} for task in images
        },
        "content": {task: next((f[task]["content"][:12] for f in found.values() if task in f), "") for task in images},
    }


def timed_reset(pool: Pool, store: Store, task: str, path: str, host: str) -> float:
    """Seconds of one reset (allocate apart) of `task`; the run must land on `host`."""
    lease = pool.allocate(task)
    try:
        started = time.perf_counter()
        lease.reset(task, task_path=path)
        seconds = time.perf_counter() - started
        placed = store.get_run(lease.id)["host"]
        if placed != host:
            raise RuntimeError(f"the reset of {task} landed on {placed}, not {host}")
        return seconds
    finally:
        lease.close()


def resets_on(bench: Bench, stack: Stack, letter: str, images: dict[str, str], known_ids: set[str]) -> list[dict]:
    """Every task's first reset on host `letter` (the others drained), then its warm resets."""
    host, client = bench.hosts[letter], bench.clients[letter]
    store = Store.from_url(stack.env["REDIS_URL"])
    others = [h for h in bench.hosts.values() if h != host]
    pool = Pool(stack.url, timeout=60, job_timeout=PREBUILD_TIMEOUT, retries=0)
    rows = []
    for other in others:
        store.set_draining(other, True)
    try:
        for task, image in images.items():
            rows.append(reset_task(bench, pool, store, client, host, task, image, known_ids))
    finally:
        for other in others:
            store.set_draining(other, False)
        pool.close()
    return rows


def reset_task(bench, pool, store, client, host, task, image, known_ids) -> dict:
    """One task's first reset on a host and its warm ones; where its image came from: present
    before the reset, pulled by it (an image id some host had already), or built by it (a new id)."""
    before = parts.client_ids(client, {task: image}).get(task)
    row = {"task": task, "first_s": None, "warm_s": [], "source": ""}
    try:
        row["first_s"] = round(timed_reset(pool, store, task, bench.task_paths[task], host), 2)
        after = parts.client_ids(client, {task: image})[task]
        row["source"] = "present" if before else ("pulled" if after["id"] in known_ids else "built")
        parts.wait_no_containers(client, host)
        for _ in range(bench.args.warm_repeats):
            row["warm_s"].append(round(timed_reset(pool, store, task, bench.task_paths[task], host), 2))
            parts.wait_no_containers(client, host)
    except Exception as exc:  # one task's failure is a row of the report, the others go on
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        bench.failures.append(f"reset {task} on {host}: {row['error']}")
        parts.wait_no_containers(client, host)
    row["warm_median_s"] = round(statistics.median(row["warm_s"]), 2) if row["warm_s"] else None
    return row


def disks(bench: Bench, letters: list[str]) -> dict:
    out = {letter: parts.image_disk(bench.clients[letter], bench.marks) for letter in letters}
    out["registry_mb"] = round(bench.registry.stored_bytes() / 1e6, 2)
    return out


# ---- the phases ---------------------------------------------------------------------------------
def single_host(bench: Bench) -> dict:
    names = copy(bench, "single", "", "s")
    stack = bench.stack({"REGISTRY_URL": "off", "DATASET_DIR": str(bench.tmp / "single")})
    bench.host("A", stack.host_id)
    try:
        log(f"single host: prebuild of {len(names)} tasks on A, no registry")
        result = prebuild(stack, "pool")
        result["images"] = builds_done(bench, image_names(names, stack), ["A"])
    finally:
        bench.stop_stack(stack)
    # The next phase starts A cold for its own tasks: this phase's images go (its layers too).
    bench.left += parts.remove_run_objects(bench.clients["A"], [], (bench.suffix + "s",))
    return result


def pool_phases(bench: Bench, result: dict) -> None:
    names = copy(bench, "pool", "v1", "p")
    stack = bench.stack({"REGISTRY_URL": bench.registry.address, "DATASET_DIR": str(bench.tmp / "pool")})
    bench.host("A", stack.host_id)
    bench.host("B", "b" + uuid.uuid4().hex[:8])
    stack.start_host(bench.hosts["B"], bench.daemons["B"].host_env())
    images = image_names(names, stack)
    result["tasks_run"] = names
    result["disk_before"] = disks(bench, ["A", "B", "C"])
    log(f"pool: prebuild of {len(names)} tasks on A and B, cold registry {bench.registry.address}")
    result["pool"] = prebuild(stack, "pool", bench.tmp / "pool" / "v1")
    result["pool"]["images"] = builds_done(bench, images, ["A", "B"])
    result["disk_after_prebuild"] = disks(bench, ["A", "B"])
    # The same command again, every image there: the CLI's own cost (its start, its wait for the
    # hosts' heartbeats, one check per task and host), the floor under each prebuild's wall time.
    result["prebuild_noop"] = prebuild(stack, "pool", bench.tmp / "pool" / "v1")
    known = set()
    for letter in ("A", "B"):
        known |= {i["id"] for i in parts.client_ids(bench.clients[letter], images).values()}
    result["resets"] = {}
    for letter in ("A", "B"):
        log(f"first and warm resets on {letter}")
        result["resets"][letter] = resets_on(bench, stack, letter, images, known)
    result["after_resets"] = builds_done(bench, images, ["A", "B"])
    log("pool: prebuild of the dataset's next version (new digests, the registry holds the base)")
    result["update"] = update(bench, stack)
    result["join"] = join(bench, stack, images, known)
    result["after_join"] = builds_done(bench, images, ["A", "B", "C"])
    result["disk_after"] = disks(bench, ["A", "B", "C"])
    result["hosts"] = dict(bench.hosts)


def copy(bench: Bench, dataset: str, version: str, suffix: str) -> list[str]:
    """A marked copy of the tasks in <tmp>/<dataset>/<version> (the stack's DATASET_DIR is
    <tmp>/<dataset>), with a new marker: new digests."""
    root = bench.tmp / dataset / version
    names = parts.copy_dataset(bench.tasks, root, bench.suffix + suffix, uuid.uuid4().hex, bench.args.build_seconds)
    bench.task_paths.update({name: f"{version}/{name}" if version else name for name in names})
    return names


def update(bench: Bench, stack: Stack) -> dict:
    """The dataset's next version on the running pool: every environment new (a new marker), the
    registry already holding the base image's layer, as it does from a pool's second dataset on."""
    names = copy(bench, "pool", "v2", "u")
    result = prebuild(stack, "pool", bench.tmp / "pool" / "v2")
    result["images"] = builds_done(bench, image_names(names, stack), ["A", "B"])
    return result


def join(bench: Bench, stack: Stack, images: dict[str, str], known: set[str]) -> dict:
    """C's workers start; the clock runs until every task's images are on C."""
    bench.host("C", "c" + uuid.uuid4().hex[:8])
    log("host C joins")
    started = time.monotonic()
    stack.start_host(bench.hosts["C"], bench.daemons["C"].host_env())
    serving = time.monotonic() - started
    warm = prebuild(stack, "all", bench.tmp / "pool" / "v1")
    ready = time.monotonic() - started
    on_c = parts.client_ids(bench.clients["C"], images)
    log("first and warm resets on C")
    return {
        "to_serving_s": round(serving, 1),
        "prebuild_all": warm,
        "to_every_task_present_s": round(ready, 1),
        "tasks_present": len(on_c),
        "pulled_not_built": all(info["id"] in known for info in on_c.values()),
        "resets": resets_on(bench, stack, "C", images, known),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    date = time.strftime("%Y%m%d-%H%M", time.gmtime())
    bench = Bench(args)
    result = {
        "date": date,
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs shared",
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "tasks": [p.name for p in bench.tasks],
        "skipped": parts.SKIPPED,
        "warm_repeats": args.warm_repeats,
        "build_seconds": args.build_seconds,
    }
    try:
        bench.set_up()
        result["single"] = single_host(bench)
        pool_phases(bench, result)
    except Exception as exc:
        bench.failures.append(f"{type(exc).__name__}: {exc}")
        log(f"failed: {exc}")
    finally:
        bench.tear_down()
    result.update(load_after=[round(x, 2) for x in os.getloadavg()], failures=bench.failures, left=bench.left)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit("bench.pool_builds", result, out / f"pool-builds-{date}.json")
    print(table(result))
    return 0 if not bench.failures and not bench.left else 1


if __name__ == "__main__":
    sys.exit(main())
