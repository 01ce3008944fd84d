#!/usr/bin/env bash
# Start dockerd when no Docker engine answers; start a local redis-server when REDIS_URL
# (default redis://localhost:6379/0) names none that answers. That Redis is durable: an
# append-only file, fsynced every second, in REDIS_DATA_DIR (default /var/lib/termpool/redis/<port>:
# one folder per port, so two Redis servers on a host never share a file),
# so a Redis restart loses no run. A Sentinel deployment (REDIS_SENTINELS set) is the
# operator's own: no Redis is started then.
# Also the pool's image registry (environments/registry_server.py): the embedded one, on
# 127.0.0.1:18082 (REGISTRY_LISTEN: another bind address) with its storage in REGISTRY_DATA_DIR,
# unless REGISTRY_URL names another host's or is off, or one answers already.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

if ! docker info >/dev/null 2>&1; then
  (dockerd >/var/log/termpool-dockerd.log 2>&1 &)
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /var/log/termpool-dockerd.log" >&2; exit 1; }
fi

(cd "$root" && python3 -m environments.registry_server start)

[ -n "${REDIS_SENTINELS:-}" ] && exit 0
url=${REDIS_URL:-redis://localhost:6379/0}
if ! python3 -c "import redis,sys; redis.Redis.from_url(sys.argv[1]).ping()" "$url" 2>/dev/null; then
  port=$(python3 -c "import sys,urllib.parse as u; print(u.urlparse(sys.argv[1]).port or 6379)" "$url")
  data_dir=${REDIS_DATA_DIR:-/var/lib/termpool/redis/$port}
  mkdir -p "$data_dir"
  redis-server --port "$port" --daemonize yes --dir "$data_dir" --save '' \
    --appendonly yes --appendfsync everysec --maxmemory-policy noeviction \
    --logfile "$data_dir/redis.log" --pidfile "$data_dir/redis-$port.pid" >/dev/null
  for _ in $(seq 1 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
