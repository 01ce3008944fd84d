#!/usr/bin/env bash
# The base image the test fixture tasks build FROM, under the tests' name
# (termpool-test-base:bookworm): made, or tagged from termpool-base:bookworm, by
# scripts/base_image.sh (see there for its settings).
set -euo pipefail
export TERMPOOL_BASE_IMAGE="${TERMPOOL_BASE_IMAGE:-termpool-test-base:bookworm}"
exec bash "$(dirname "$0")/../scripts/base_image.sh"
