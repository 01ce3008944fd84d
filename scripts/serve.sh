#!/usr/bin/env bash
# Run termpool on this host: set up, start the backends (dockerd, Redis, the pool's image
# registry: scripts/start-backends.sh), then every process of the Procfile
# (facade, one worker pool per queue, beat, flower) under supervisord, in the foreground.
# A process that dies is started again; Ctrl-C (or TERM) stops them all, letting running
# jobs finish first (up to 60 s).
#
#   DATASET_DIR       the task dataset (default: this repository's examples/tasks, four small
#                     tasks that build FROM termpool-base:bookworm, which is made here when missing)
#   TERMPOOL_RUN_DIR  supervisord's generated config, pid file and control socket
#                     (default /run/termpool-serve); one per instance on a host
#   TERMPOOL_LOG_DIR  one log file per process, and supervisord's (default /var/log/termpool)
#
#   python3 -m supervisor.supervisorctl -c "$TERMPOOL_RUN_DIR/supervisord.conf" status
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/start-backends.sh
if [ -z "${DATASET_DIR:-}" ]; then
  export DATASET_DIR=$PWD/examples/tasks
  bash scripts/base_image.sh >/dev/null  # the examples' base image (debootstrap, no registry)
fi
export TBENCH_OUTPUT_ROOT=${TBENCH_OUTPUT_ROOT:-terminal-rl/build_outputs}
mkdir -p "$DATASET_DIR" "$TBENCH_OUTPUT_ROOT"
run_dir=${TERMPOOL_RUN_DIR:-/run/termpool-serve}
log_dir=${TERMPOOL_LOG_DIR:-/var/log/termpool}
mkdir -p "$run_dir" "$log_dir"
python3 deploy/supervisord_conf.py --procfile Procfile --run-dir "$run_dir" --log-dir "$log_dir" \
  > "$run_dir/supervisord.conf"
echo "termpool: serving $DATASET_DIR on port ${ENV_SERVER_PORT:-18081}" >&2
echo "termpool: logs in $log_dir; python3 -m supervisor.supervisorctl -c $run_dir/supervisord.conf status" >&2
# One "ready" line once /readyz answers 200 (a worker host serves every queue kind). Work sent
# earlier, from the first /healthz on, is not refused: it waits in its queue.
python3 - "${ENV_SERVER_PORT:-18081}" >&2 <<'EOF' &
import sys, time, urllib.request as u
opener, url = u.build_opener(u.ProxyHandler({})), f"http://127.0.0.1:{sys.argv[1]}/readyz"
for _ in range(1200):  # ten minutes at most
    try:
        opener.open(url, timeout=2)
        print(f"termpool: ready on port {sys.argv[1]} (GET /readyz answers 200)", flush=True)
        break
    except Exception:
        time.sleep(0.5)
EOF
exec python3 -m supervisor.supervisord -c "$run_dir/supervisord.conf"
