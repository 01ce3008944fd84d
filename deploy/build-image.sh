#!/usr/bin/env bash
# Build termpool's image from the top-level Dockerfile, with no PyPI access from inside the
# build (only the base image's apt sources are used there):
#
#   1. deploy/wheelhouse/: wheels of requirements.txt (plus pip itself) made on this host with
#      $PYTHON -m pip for the base image's python3 (deploy/wheelhouse.py); remade only when
#      requirements.txt, $PYTHON, its pip or the base image's Python changed.
#   2. docker build --build-arg BASE_IMAGE=..., tagged $TERMPOOL_IMAGE and labelled with a hash
#      of every input (code, requirements, wheelhouse, Dockerfile, base image id); skipped when
#      the tag already carries that hash.
#
# Prints the image id (sha256:...) on stdout when done; progress and errors go to stderr.
#
# Environment:
#   BASE_IMAGE      base image (default python:3.11-slim-bookworm). Where no registry is
#                   reachable: bash tests/base_image.sh, then BASE_IMAGE=termpool-test-base:bookworm
#   TERMPOOL_IMAGE  tag to build (default termpool:local)
#   PYTHON          python that builds the wheelhouse (default python3); it must be the same
#                   X.Y as the base image's python3 (the build checks)
#   TERMPOOL_IMAGE_REBUILD=1  build even when the tag is up to date
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim-bookworm}
TAG=${TERMPOOL_IMAGE:-termpool:local}
PYTHON=${PYTHON:-python3}
WHEELHOUSE=deploy/wheelhouse
LABEL=termpool.image.inputs

log() { echo "build-image.sh: $*" >&2; }
die() { log "$*"; exit 1; }

command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot talk to the Docker daemon"

# One build at a time per tag on this Docker host (other work trees may build the same tag).
lock="${TMPDIR:-/tmp}/termpool-build-image.$(printf '%s' "$TAG" | tr -c 'A-Za-z0-9_.-' '_').lock"
exec 9>"$lock"
flock 9

# ---- 1. the wheelhouse ------------------------------------------------------------------------
# For the base image's Python (markers may pull in dependencies the host's Python does not need).
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
base_py=$(docker run --rm --network none --entrypoint python3 "$BASE_IMAGE" \
              -c 'import platform; print(platform.python_version())' 2>/dev/null) \
    || die "cannot run python3 in the base image $BASE_IMAGE (is it a Debian image with python3?)"
[[ "${base_py%.*}" == "$pyver" ]] \
    || die "$BASE_IMAGE has Python $base_py but $PYTHON is $pyver: wheels must be built by the same Python X.Y (set PYTHON)"
pipver=$("$PYTHON" -m pip --version | awk '{print $2}')
stamp=$({ cat requirements.txt deploy/wheelhouse.py; echo "python $pyver pip $pipver target $base_py"; } \
        | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$WHEELHOUSE/STAMP" 2>/dev/null)" != "$stamp" ]]; then
    log "building the wheelhouse with $PYTHON ($pyver) for Python $base_py ..."
    tmp=$(mktemp -d "$WHEELHOUSE.tmp.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    if ! "$PYTHON" deploy/wheelhouse.py requirements.txt "$tmp/wheels" "$base_py" >"$tmp/pip.log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$tmp/pip.log" | tail -n 40 >&2
        die "building the wheelhouse failed"
    fi
    echo "$stamp" >"$tmp/wheels/STAMP"
    rm -rf "$WHEELHOUSE"
    mv "$tmp/wheels" "$WHEELHOUSE"
    rm -rf "$tmp"
    trap - EXIT
fi

# ---- 2. the image ---------------------------------------------------------------------------------
# Every input the Dockerfile reads (see .dockerignore), by content.
base_id=$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || echo "$BASE_IMAGE")
inputs=$({
    echo "base $base_id"
    find Dockerfile .dockerignore requirements.txt Procfile app cli environments tasks termpool "$WHEELHOUSE" \
        -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*/.pytest_cache/*' \
        ! -name 'tp-session' ! -name 'tp-session.*' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum
} | sha256sum | cut -d' ' -f1)

if [[ "${TERMPOOL_IMAGE_REBUILD:-0}" != 1 ]] \
   && [[ "$(docker image inspect -f "{{index .Config.Labels \"$LABEL\"}}" "$TAG" 2>/dev/null)" == "$inputs" ]]; then
    log "$TAG is up to date"
    docker image inspect -f '{{.Id}}' "$TAG"
    exit 0
fi

# The classic builder where the buildx plugin is missing (the docker CLI refuses BuildKit then).
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
fi

log "building $TAG from $BASE_IMAGE ..."
previous=$(docker image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
if ! docker build --force-rm --build-arg BASE_IMAGE="$BASE_IMAGE" --label "$LABEL=$inputs" \
        --iidfile "$work/iid" -t "$TAG" -f Dockerfile . >"$work/build.log" 2>&1; then
    tail -n 60 "$work/build.log" >&2
    die "docker build failed"
fi
image=$(cat "$work/iid")
log "built $TAG in $(( $(date +%s) - started )) s"
# Drop the image this tag pointed to before, unless something still uses it (a running stack,
# another tag): rebuilds after every code change would otherwise pile up untagged images.
if [[ -n "$previous" && "$previous" != "$image" ]] \
   && [[ -z "$(docker image inspect -f '{{join .RepoTags ","}}' "$previous" 2>/dev/null)" ]]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
# Likewise the builder stages' images of earlier builds (the newest of each stage is the cache).
for stage in helper venv; do
    docker images -q --no-trunc --filter dangling=true --filter "label=termpool.build-stage=$stage" \
        | tail -n +2 | xargs -r docker rmi >/dev/null 2>&1 || true
done
echo "$image"
