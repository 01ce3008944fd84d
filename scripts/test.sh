#!/usr/bin/env bash
# The test command: set up this host, start the backends, build the test base image, run
# every test (the tests start their own Redis, Celery workers and gunicorn).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
bash scripts/start-backends.sh
bash tests/base_image.sh >/dev/null
exec python3 -m pytest "$@"
