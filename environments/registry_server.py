"""The pool's embedded image registry: Debian's docker-registry (the CNCF distribution registry)
serving deploy/registry.yml, started when REGISTRY_URL names none (its default) or names a
loopback address nothing answers on, as scripts/start-backends.sh does for Redis:

    python3 -m environments.registry_server start     # idempotent; what start-backends.sh runs
    python3 -m environments.registry_server gc        # docker-registry garbage-collect

Another host's registry (REGISTRY_URL=host:port) or REGISTRY_URL=off: nothing is started.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import requests

from poolcore.config import RegistrySettings, load_registry

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "registry.yml"
BINARY = "docker-registry"
START_SECONDS = 15.0


def split_address(address: str) -> tuple[str, int]:
    """host[:port] as (host, port); a registry named without a port listens on 80 (plain HTTP)."""
    if ":" not in address.rpartition("]")[2]:  # no port after the host (an IPv6 one in brackets)
        return address, 80
    host, _, port = address.rpartition(":")
    return host, int(port)


def is_local(cfg: RegistrySettings) -> bool:
    """Whether REGISTRY_URL names this machine's loopback: the registry this host may start."""
    if not cfg.enabled:
        return False
    host = split_address(cfg.address)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def answers(cfg: RegistrySettings) -> bool:
    """Whether something speaks the registry API at cfg.api: GET /v2/ answers 200 or 401."""
    try:
        # trust_env False: a proxy from the environment must not stand between us and loopback
        with requests.Session() as session:
            session.trust_env = False
            reply = session.get(cfg.api + "/v2/", timeout=cfg.timeout)
    except requests.RequestException:
        return False
    return reply.status_code in (200, 401)


def server_env(cfg: RegistrySettings, listen: str) -> dict:
    """The registry's own environment overrides of deploy/registry.yml. termpool's REGISTRY_*
    settings are left out: the registry reads every REGISTRY_* variable as a config key."""
    return {
        **{key: value for key, value in os.environ.items() if not key.startswith("REGISTRY_")},
        "REGISTRY_HTTP_ADDR": listen,
        "REGISTRY_STORAGE_FILESYSTEM_ROOTDIRECTORY": str(cfg.data_dir),
        # signs upload state between requests; one instance, so a fresh one per start is fine
        "REGISTRY_HTTP_SECRET": secrets.token_hex(16),
    }


def ensure_running(cfg: RegistrySettings, listen: str = "") -> str:
    """Start the embedded registry unless one answers already; returns what was done. listen:
    the address it binds (REGISTRY_LISTEN, e.g. 0.0.0.0:18082 for other machines), by default
    REGISTRY_URL's own. Raises RuntimeError when it cannot be started."""
    if not is_local(cfg):
        return "registry not started: " + (
            "REGISTRY_URL=off" if not cfg.enabled else f"{cfg.address} is another host's"
        )
    if answers(cfg):
        return f"registry {cfg.address} already answers"
    if shutil.which(BINARY) is None:
        raise RuntimeError(f"{BINARY} is not installed (scripts/setup.sh installs it: apt-get install docker-registry)")
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    log = open(cfg.data_dir / "registry.log", "ab")  # noqa: SIM115 (the server's output: it outlives this call)
    proc = subprocess.Popen(
        [BINARY, "serve", str(CONFIG)],
        env=server_env(cfg, listen or cfg.address),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # outlives the script that started it, as the daemonized Redis does
    )
    log.close()
    (cfg.data_dir / "registry.pid").write_text(f"{proc.pid}\n")
    return _wait_started(cfg, proc)


def _wait_started(cfg: RegistrySettings, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if answers(cfg):
            return f"registry {cfg.address} started (pid {proc.pid}, storage {cfg.data_dir})"
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(
        f"registry {cfg.address} did not start; see {cfg.data_dir / 'registry.log'} (REGISTRY_URL=off: none)"
    )


def garbage_collect(cfg: RegistrySettings, dry_run: bool = False) -> str:
    """Remove the blobs no manifest references any more from the embedded registry's storage
    (`docker-registry garbage-collect --delete-untagged`); returns its output's last line. Run
    after reclaim deleted manifests. A push racing it may lose a blob: that push's image then
    fails to pull, which the caller treats as absent and builds (upstream advises read-only)."""
    if not is_local(cfg) or shutil.which(BINARY) is None or not cfg.data_dir.is_dir():
        return "no local registry storage to collect"
    argv = [BINARY, "garbage-collect", "--delete-untagged", *(["--dry-run"] if dry_run else []), str(CONFIG)]
    done = subprocess.run(argv, env=server_env(cfg, cfg.address), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"registry {cfg.address}: garbage-collect failed: {done.stderr.strip()[-500:]}")
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else "nothing to collect"


def main(argv: list[str]) -> int:
    try:
        cfg = load_registry()
        if argv[1:2] == ["start"]:
            print(f"termpool: {ensure_running(cfg, os.environ.get('REGISTRY_LISTEN', '').strip())}", file=sys.stderr)
        elif argv[1:2] == ["gc"]:
            print(garbage_collect(cfg, dry_run="--dry-run" in argv))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (ValueError, RuntimeError) as error:
        print(f"termpool: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
