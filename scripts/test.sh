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
# Two phases. First the test files side by side, each whole on one of TEST_WORKERS (default 2)
# pytest-xdist workers (its module stacks and fixtures stay together; every worker has its own
# session stack; stacks are labelled per host id with their own run-network range, so they
# coexist on one dockerd). Then the files marked `alone` (tests/conftest.py ALONE: they kill
# workers, restart daemons or compare timings, which a neighbour's load would make lie), one at
# a time. About 38 min on the 2-core machine against about 55 serially (TEST_WORKERS=0: one
# phase). pytest-benchmark, where installed, would warn that xdist disables it: no test here
# uses it.
workers="${TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
    exec python3 -m pytest -p no:benchmark "$@"
fi
status=0
# Exit 5 (nothing collected) is no failure of a phase: arguments may name only one kind of file.
python3 -m pytest -n "$workers" --dist loadfile -p no:benchmark -m "not alone" "$@" || { code=$?; [ "$code" = 5 ] || status=$code; }
python3 -m pytest -p no:benchmark -m alone "$@" || { code=$?; [ "$code" = 5 ] || status=$code; }
exit "$status"
