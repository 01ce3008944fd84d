"""A second Docker daemon on this machine, standing for a second worker host.

Its own data root, exec root (so its own managed containerd), unix socket, pid file and
bridge interface (created here, so the two daemons do not share docker0), and its own
address pool, so the networks its compose projects get never overlap the first daemon's.
iptables stays on, as on any Docker host. The test base image is copied into it with
`docker save | docker load`. Used by tests/test_many_hosts.py (tests/second_docker.py's
fixture) and bench/hosts.py.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import docker

from devstack.slots import take_slot

# Second daemons run side by side (a session's fixture, a chaos scenario, another test run on the
# machine), each in a slot of its own: its bridge address and its networks' address pool, away
# from Docker's defaults (172.17-31.x, 192.168.x) the first daemon uses and from each other. A
# slot is held by a lock file (flock) from start to stop; a start waits for a free one.
SLOTS = 4
LOCK_PATH = "/run/termpool-second-docker-{slot}.lock"
SLOT_WAIT_SECONDS = 1800.0


def bridge_cidr(slot: int) -> str:
    return f"10.213.{slot}.1/24"


def address_pool(slot: int) -> str:
    return f"base=10.{214 + slot}.0.0/17,size=24"


def run_subnets(slot: int) -> str:
    """RUN_SUBNETS of a worker host on this daemon: the other half of its slot's /16, away from
    the first daemon's hosts (devstack/stack.py), whose bridges share this network namespace."""
    return f"10.{214 + slot}.128.0/17"


class SecondDocker:
    def __init__(self, name: str | None = None, experimental: bool = False, path_first: str = "", args=()):
        """experimental: dockerd --experimental (checkpoints); path_first: a folder put first on
        the daemon's PATH (its containerd and runc find `criu` there: devstack/criu.py); args:
        more dockerd options."""
        self.experimental, self.path_first, self.args = experimental, path_first, list(args)
        self.name = name or "tpd" + secrets.token_hex(3)
        self.bridge = "br-" + self.name  # within iptables' 15 characters; br-+ is a task interface
        self.root = Path(tempfile.mkdtemp(prefix=f"termpool-{self.name}-"))
        self.socket = f"/run/{self.name}.sock"
        self.host = "unix://" + self.socket
        self.pidfile = self.root / "dockerd.pid"
        self.proc: subprocess.Popen | None = None
        self._lock = None
        self.slot = 0

    def argv(self) -> list[str]:
        return [
            "dockerd",
            "--data-root",
            str(self.root / "data"),
            "--exec-root",
            str(self.root / "exec"),
            "-H",
            self.host,
            "--pidfile",
            str(self.pidfile),
            "--bridge",
            self.bridge,
            "--default-address-pool",
            address_pool(self.slot),
            "--default-runtime",
            "runc",
            "--containerd-namespace",
            self.name,
            "--containerd-plugins-namespace",
            self.name + "-plugins",
            *(["--experimental"] if self.experimental else []),
            *self.args,
        ]

    def start(self, timeout: float = 90) -> SecondDocker:
        self._take_slot()
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
        subprocess.run(["ip", "addr", "add", bridge_cidr(self.slot), "dev", self.bridge], check=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)
        self._launch(timeout)
        return self

    def _take_slot(self) -> None:
        self.slot, self._lock = take_slot(LOCK_PATH, SLOTS, SLOT_WAIT_SECONDS)

    def _launch(self, timeout: float) -> None:
        """Start dockerd with argv() and wait until it answers."""
        log = open(self.root / "dockerd.log", "ab")  # noqa: SIM115 (the daemon's output: it outlives this call)
        env = {**os.environ, "PATH": f"{self.path_first}:{os.environ['PATH']}"} if self.path_first else None
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd {self.name} exited; see {self.root / 'dockerd.log'}")
            try:
                if self.client().ping():
                    return
            except docker.errors.DockerException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"dockerd {self.name} did not answer within {timeout} s")

    def restart(self, timeout: float = 90) -> dict:
        """Restart the daemon as an upgrade does: SIGTERM to its pid, then the same argv and
        data root again. Without --live-restore in `args` the containers it ran are stopped
        (their processes die). Returns the pids and the seconds it was down."""
        old = self.proc.pid
        down = time.monotonic()
        self.halt()
        stopped = time.monotonic()
        self.resume(timeout)
        return {
            "old_pid": old,
            "new_pid": self.proc.pid,
            "stop_s": round(stopped - down, 1),
            "down_s": round(time.monotonic() - down, 1),
        }

    def halt(self) -> None:
        """The first half of a restart: SIGTERM to the daemon, and wait for it to exit."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)

    def resume(self, timeout: float = 90) -> None:
        """The second half: the same argv and data root again, once it answers."""
        bridge = DefaultBridge.snapshot()
        self._launch(timeout)
        if bridge is not None:
            bridge.restore_if_deleted()

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, timeout=120)

    def env(self) -> dict:
        return {**os.environ, "DOCKER_HOST": self.host}

    def host_env(self) -> dict:
        """What a worker host on this daemon adds to a stack's settings (Stack.start_host)."""
        return {"DOCKER_HOST": self.host, "RUN_SUBNETS": run_subnets(self.slot)}

    def load_image(self, image: str) -> None:
        """Copy an image of the first daemon into this one."""
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
        subprocess.run(["docker", "load", "-q"], stdin=save.stdout, env=self.env(), check=True, capture_output=True)
        save.stdout.close()
        if save.wait() != 0:
            raise RuntimeError(f"docker save {image} failed")

    def stop(self) -> None:
        """Stop the daemon by its pid (its containers first), remove its files and bridge."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                client = self.client()
                for container in client.containers.list(all=True):
                    container.remove(force=True)
                client.close()
            except docker.errors.DockerException:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)
        _remove_tree(self.root)
        Path(self.socket).unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None


class DefaultBridge:
    """The first daemon's docker0, kept across a restart of this one: dockerd 20.10, started
    again on a data root that has its network store, deletes docker0 (the other daemon's default
    bridge, in the same network namespace), which breaks the first daemon's default network.
    A host has one daemon in production; here the bridge is put back as it was (its addresses
    and the container interfaces it held)."""

    NAME = "docker0"
    WATCH_SECONDS = 5.0  # the deletion lands while the daemon starts, or just after it answers

    def __init__(self, addresses: list[str], ports: list[str]):
        self.addresses, self.ports = addresses, ports

    @classmethod
    def snapshot(cls) -> DefaultBridge | None:
        shown = subprocess.run(["ip", "-j", "addr", "show", cls.NAME], capture_output=True, text=True)
        if shown.returncode != 0:
            return None
        (link,) = json.loads(shown.stdout)
        addresses = [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("family") == "inet"]
        ports = subprocess.run(["ip", "-j", "link", "show", "master", cls.NAME], capture_output=True, text=True)
        return cls(addresses, [port["ifname"] for port in json.loads(ports.stdout or "[]")])

    def restore_if_deleted(self) -> None:
        deadline = time.monotonic() + self.WATCH_SECONDS
        while time.monotonic() < deadline:
            if subprocess.run(["ip", "link", "show", self.NAME], capture_output=True).returncode != 0:
                self._recreate()
                return
            time.sleep(0.1)

    def _recreate(self) -> None:
        subprocess.run(["ip", "link", "add", self.NAME, "type", "bridge"], check=True)
        for address in self.addresses:
            subprocess.run(["ip", "addr", "add", address, "dev", self.NAME], check=True)
        subprocess.run(["ip", "link", "set", self.NAME, "up"], check=True)
        for port in self.ports:  # a container interface gone meanwhile is left out
            subprocess.run(["ip", "link", "set", port, "master", self.NAME], capture_output=True)


def _remove_tree(root: Path) -> None:
    """The data root holds overlay mounts until the daemon has unmounted them: unmount what is
    left (deepest first), then remove."""
    mounts = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(str(root))
    ]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
