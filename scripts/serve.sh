#!/usr/bin/env bash
# Run termpool on this host: set up, start the backends, then every process of the
# Procfile (facade, one worker pool per queue, beat, flower) under honcho.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/start-backends.sh
export DATASET_DIR=${DATASET_DIR:-terminal-rl/dataset} TBENCH_OUTPUT_ROOT=${TBENCH_OUTPUT_ROOT:-terminal-rl/build_outputs}
mkdir -p "$DATASET_DIR" "$TBENCH_OUTPUT_ROOT"
exec python3 -m honcho start -f Procfile
