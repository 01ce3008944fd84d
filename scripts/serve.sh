#!/usr/bin/env bash
# Run termpool on this host: set up, start the backends, then every process of the Procfile
# (facade, one worker pool per queue, beat, flower) under supervisord, in the foreground.
# A process that dies is started again; Ctrl-C (or TERM) stops them all, letting running
# jobs finish first (up to 60 s).
#
#   TERMPOOL_RUN_DIR  supervisord's generated config, pid file and control socket
#                     (default /run/termpool-serve); one per instance on a host
#   TERMPOOL_LOG_DIR  one log file per process, and supervisord's (default /var/log/termpool)
#
#   python3 -m supervisor.supervisorctl -c "$TERMPOOL_RUN_DIR/supervisord.conf" status
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/start-backends.sh
export DATASET_DIR=${DATASET_DIR:-terminal-rl/dataset} TBENCH_OUTPUT_ROOT=${TBENCH_OUTPUT_ROOT:-terminal-rl/build_outputs}
mkdir -p "$DATASET_DIR" "$TBENCH_OUTPUT_ROOT"
run_dir=${TERMPOOL_RUN_DIR:-/run/termpool-serve}
log_dir=${TERMPOOL_LOG_DIR:-/var/log/termpool}
mkdir -p "$run_dir" "$log_dir"
python3 deploy/supervisord_conf.py --procfile Procfile --run-dir "$run_dir" --log-dir "$log_dir" \
  > "$run_dir/supervisord.conf"
echo "termpool: logs in $log_dir; python3 -m supervisor.supervisorctl -c $run_dir/supervisord.conf status" >&2
exec python3 -m supervisor.supervisord -c "$run_dir/supervisord.conf"
