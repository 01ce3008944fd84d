"""A sampling thread: RSS of termpool's own processes by kind, live runs from /status, and
CPU time by process group over measurement windows.

Every `interval` seconds it sums the resident memory of each stack process together with all
its descendants (gunicorn's master and workers are the facade; each Celery worker kind with
any pool children; beat; Flower; redis-server), and reads /status for the number of live runs.
Peaks are kept per phase (the label the benchmark sets) and for the whole run.

CPU (`CpuMeter`, read from /proc) is counted over windows the benchmark opens and closes:

- each stack process kind (facade, build, lifecycle, exec, eval, teardown, beat, flower, redis)
  and the Docker daemons (dockerd, containerd): the whole process tree's user+system time,
  children that exited and were reaped included (cutime/cstime), at the window's two ends;
- containerd shims and runc: these are re-parented to init, so they are sampled every
  `cpu_interval` seconds and each one's own time is summed (last seen minus first seen, or
  from zero when it started inside the window). What a shim spends after its last sample, and
  runc processes too short-lived to be seen, are missed: a lower bound;
- the containers (every container of the machine, not only the benchmark's): each one's
  cgroup (cgroup v1 cpuacct, /sys/fs/cgroup/cpuacct/docker/<id>), sampled the same way;
- the benchmark process itself (its HTTP clients, the floor's SDK calls, this thread);
- the whole machine (/proc/stat: every CPU's non-idle time, other users of the machine too).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from termpool.client import Pool

MB = 1024 * 1024
FACADE = "facade"
TICK = os.sysconf("SC_CLK_TCK")
DOCKER_DAEMONS = ("dockerd", "containerd")
CONTAINER_CGROUPS = Path("/sys/fs/cgroup/cpuacct/docker")


# ---- CPU from /proc -------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    ppid: int
    start: int  # clock ticks after boot
    own: int  # utime + stime, ticks
    reaped: int  # cutime + cstime: children that exited and were waited for, ticks


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    comm = data[data.index("(") + 1 : data.rindex(")")]
    fields = data[data.rindex(")") + 2 :].split()  # fields[0] is field 3 (state) of proc(5)
    return ProcStat(
        pid=pid,
        comm=comm,
        ppid=int(fields[1]),
        start=int(fields[19]),
        own=int(fields[11]) + int(fields[12]),
        reaped=int(fields[13]) + int(fields[14]),
    )


def scan() -> dict[int, ProcStat]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None:
                out[stat.pid] = stat
    return out


def machine_busy_ticks() -> int:
    """Non-idle time of every CPU: user nice system (idle iowait) irq softirq steal."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    return sum(values) - values[3] - values[4]


def tree_ticks(procs: dict[int, ProcStat], root: int, other_roots: set[int]) -> int:
    """User+system time of a process and its descendants (reaped children included), not
    descending into the trees of other groups (containerd is dockerd's child here)."""
    children: dict[int, list[int]] = {}
    for stat in procs.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    total, todo = 0, [root] if root in procs else []
    while todo:
        pid = todo.pop()
        total += procs[pid].own + procs[pid].reaped
        todo += [child for child in children.get(pid, []) if child not in other_roots]
    return total


def container_seconds() -> dict[str, float]:
    """CPU-seconds of each live container's cgroup, by container id (none without cgroup v1)."""
    out = {}
    try:
        entries = list(os.scandir(CONTAINER_CGROUPS))
    except OSError:
        return out
    for entry in entries:
        try:
            out[entry.name] = int((Path(entry.path) / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            pass
    return out


def sampled_group(comm: str) -> str | None:
    if comm.startswith("containerd-shim"):
        return "containerd-shim"
    if comm.startswith("runc"):
        return "runc"
    return None


class CpuMeter:
    """CPU-seconds per process group over one window at a time (see the module docstring)."""

    def __init__(self, stack_roots):
        self.stack_roots = stack_roots  # () -> {kind: [root pid, ...]} of the stack's processes
        self._window: dict | None = None

    def _trees(self, procs: dict[int, ProcStat]) -> dict[str, int]:
        roots = {kind: list(pids) for kind, pids in self.stack_roots().items()}
        for stat in procs.values():
            if stat.comm in DOCKER_DAEMONS:
                roots.setdefault(stat.comm, []).append(stat.pid)
        every_root = {pid for pids in roots.values() for pid in pids}
        return {kind: sum(tree_ticks(procs, pid, every_root) for pid in pids) for kind, pids in roots.items()}

    def _track(self, procs: dict[int, ProcStat], first_scan: bool) -> None:
        current = {(s.pid, s.start): (group, s.own / TICK) for s in procs.values() if (group := sampled_group(s.comm))}
        current.update({cid: ("containers", secs) for cid, secs in container_seconds().items()})
        seen = self._window["sampled"]
        for key, (group, seconds) in current.items():
            if key not in seen:  # present at the start: counted from now; born since: from zero
                seen[key] = [group, seconds if first_scan else 0.0, seconds]
            seen[key][2] = seconds

    def begin(self) -> None:
        procs = scan()
        self._window = {
            "t": time.monotonic(),
            "machine": machine_busy_ticks(),
            "self": sum(os.times()[:2]),
            "trees": self._trees(procs),
            "sampled": {},
        }
        self._track(procs, first_scan=True)

    def sample(self) -> None:
        if self._window is not None:
            self._track(scan(), first_scan=False)

    def end(self) -> dict:
        """CPU-seconds per group since begin(), and the window's wall time."""
        window, procs = self._window, scan()
        self._track(procs, first_scan=False)
        self._window = None
        trees = self._trees(procs)
        cpu = {kind: (trees[kind] - window["trees"].get(kind, 0)) / TICK for kind in trees}
        for group in ("containerd-shim", "runc", "containers"):
            cpu.setdefault(group, 0.0)
        for group, first, last in window["sampled"].values():
            cpu[group] += last - first
        cpu["bench"] = sum(os.times()[:2]) - window["self"]
        cpu["machine"] = (machine_busy_ticks() - window["machine"]) / TICK
        return {"wall_s": round(time.monotonic() - window["t"], 3), "cpu_s": {k: round(v, 3) for k, v in cpu.items()}}


def kind_of(proc_name: str) -> str:
    return FACADE if proc_name == "web" else proc_name


class Monitor:
    def __init__(self, procs: dict, url: str, interval: float = 0.5, cpu_interval: float = 0.25):
        self.procs = procs  # name -> Popen, as devstack.Stack keeps them
        self.interval = interval
        self.cpu_interval = cpu_interval
        self.cpu = CpuMeter(self.stack_roots)
        self._cpu_lock = threading.Lock()
        self.phase = "setup"
        self.samples = 0
        self.peaks: dict[str, dict] = {}  # phase -> {"total_mb", "by_kind_mb": {...}, "live_runs"}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self._client = Pool(url, timeout=5, retries=0)  # a sample, not a must: never waits for one
        self._cache: dict[int, psutil.Process] = {}

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # a Monitor used for its readings only has no thread
            self._thread.join(timeout=10)
        self._client.close()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase

    def stack_roots(self) -> dict[str, list[int]]:
        roots: dict[str, list[int]] = {}
        for name, popen in list(self.procs.items()):
            roots.setdefault(kind_of(name), []).append(popen.pid)
        return roots

    def cpu_begin(self) -> None:
        with self._cpu_lock:
            self.cpu.begin()

    def cpu_end(self) -> dict:
        with self._cpu_lock:
            return self.cpu.end()

    # ---- sampling -------------------------------------------------------------------------
    def _process(self, pid: int) -> psutil.Process | None:
        proc = self._cache.get(pid)
        if proc is None:
            try:
                proc = self._cache[pid] = psutil.Process(pid)
            except psutil.Error:
                return None
        return proc

    def rss_by_kind(self) -> dict[str, float]:
        """MB resident, each stack process with all its descendants, by kind."""
        return self._per_kind(lambda proc: proc.memory_info().rss / MB)

    def fds_by_kind(self) -> dict[str, float]:
        """Open file descriptors (files, sockets, pipes), each stack process with all its
        descendants, by kind: what a leak of connections or files would show."""
        return self._per_kind(lambda proc: float(proc.num_fds()))

    def _per_kind(self, measure) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, popen in list(self.procs.items()):
            root = self._process(popen.pid)
            if root is None:
                continue
            total = 0.0
            try:
                members = [root, *root.children(recursive=True)]
            except psutil.Error:
                members = [root]
            for proc in members:
                try:
                    total += measure(proc)
                except psutil.Error:
                    pass
            kind = kind_of(name)
            out[kind] = out.get(kind, 0.0) + total
        return out

    def live_runs(self) -> int | None:
        try:
            return int(self._client.status()["total_active_runs"])
        except Exception:
            return None

    def _loop(self) -> None:
        next_memory = 0.0
        while not self._stop.is_set():
            started = time.monotonic()
            with self._cpu_lock:
                self.cpu.sample()
            if started >= next_memory:
                next_memory = started + self.interval
                self._sample_memory()
            self._stop.wait(max(0.0, self.cpu_interval - (time.monotonic() - started)))

    def _sample_memory(self) -> None:
        by_kind = self.rss_by_kind()
        live = self.live_runs()
        with self._lock:
            self.samples += 1
            for phase in (self.phase, "all"):
                peak = self.peaks.setdefault(phase, {"total_mb": 0.0, "by_kind_mb": {}, "live_runs": 0})
                peak["total_mb"] = max(peak["total_mb"], sum(by_kind.values()))
                for kind, mb in by_kind.items():
                    peak["by_kind_mb"][kind] = max(peak["by_kind_mb"].get(kind, 0.0), mb)
                if live is not None:
                    peak["live_runs"] = max(peak["live_runs"], live)

    def peak(self, phase: str) -> dict:
        with self._lock:
            peak = self.peaks.get(phase) or {"total_mb": 0.0, "by_kind_mb": {}, "live_runs": 0}
            return {
                "total_mb": round(peak["total_mb"], 1),
                "by_kind_mb": {k: round(v, 1) for k, v in sorted(peak["by_kind_mb"].items())},
                "live_runs": peak["live_runs"],
            }

    def peak_over(self, phases: list[str]) -> dict:
        """The highest figures over several phases (e.g. every phase of one concurrency level)."""
        total, by_kind, live = 0.0, {}, 0
        for phase in phases:
            peak = self.peak(phase)
            total = max(total, peak["total_mb"])
            live = max(live, peak["live_runs"])
            for kind, mb in peak["by_kind_mb"].items():
                by_kind[kind] = max(by_kind.get(kind, 0.0), mb)
        return {"total_mb": round(total, 1), "by_kind_mb": dict(sorted(by_kind.items())), "live_runs": live}
