#!/usr/bin/env bash
# The test command: set up this host, start the backends (dockerd, Redis, the embedded image
# registry that tests/test_registry.py checks), build the test base image, run
# every test (the tests start their own Redis, Celery workers and gunicorn). Lint and format
# are checked first: a finding fails the run before any test starts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
python3 -m ruff check .
python3 -m ruff format --check .
bash scripts/start-backends.sh
bash tests/base_image.sh >/dev/null
# Two phases. First the test files side by side, each whole on one of TEST_WORKERS pytest-xdist
# workers (its module stacks and fixtures stay together; every worker has its own session
# stack; stacks are labelled per host id with their own run-network range, so they coexist
# on one dockerd). Then the files marked `alone` (tests/conftest.py ALONE: they kill workers,
# restart daemons or compare timings, which a neighbour's load would make lie), one at a time.
# TEST_WORKERS=0, the default for now, runs everything in one serial phase: the two rehearsals
# at 2 workers (37.5 and about 38 min, against about 55 serial) each met one race between test files
# that share the machine (packet-filter rules, image listings; both fixed), and a third may
# be waiting. pytest-benchmark, where installed, would warn that xdist disables it: no test
# here uses it.
workers="${TEST_WORKERS:-0}"
if [ "$workers" = 0 ]; then
    exec python3 -m pytest -p no:benchmark "$@"
fi
status=0
python3 -m pytest -n "$workers" --dist loadfile -p no:benchmark -m "not alone" "$@" || status=$?
python3 -m pytest -p no:benchmark -m alone "$@" || { code=$?; [ "$code" = 5 ] || status=$code; }
exit "$status"
