#!/usr/bin/env bash
# Make the base image the example tasks (examples/tasks) and the test fixture tasks build
# FROM, with no registry: termpool-base:bookworm (the tests call it termpool-test-base:bookworm,
# through tests/base_image.sh; both names are the same image).
#
# Idempotent: does nothing when the image already exists; when it exists under the other
# name it is only tagged. Otherwise it bootstraps a
# minimal Debian bookworm root filesystem with debootstrap (bash, tmux, python3, pytest),
# keeps it in a cache folder for next time, and imports it with `docker import`.
# Quiet unless something fails; prints the image tag on success.
#
# Environment:
#   TERMPOOL_BASE_IMAGE   image tag to make          (default termpool-base:bookworm)
#   TERMPOOL_BASE_CACHE   where the rootfs is cached (default /var/cache/termpool/base-rootfs)
#   TERMPOOL_BASE_ROOTFS  an existing, finished debootstrap rootfs to import instead
#   TERMPOOL_BASE_MIRROR  Debian mirror             (default http://deb.debian.org/debian)
#   TERMPOOL_BASE_SUITE   Debian suite              (default bookworm)
#   TERMPOOL_BASE_REBUILD set to 1 to re-import even if the image exists
set -euo pipefail

TAG="${TERMPOOL_BASE_IMAGE:-termpool-base:bookworm}"
ALIASES="termpool-base:bookworm termpool-test-base:bookworm"  # names of the same image
CACHE="${TERMPOOL_BASE_CACHE:-/var/cache/termpool/base-rootfs}"
MIRROR="${TERMPOOL_BASE_MIRROR:-http://deb.debian.org/debian}"
SUITE="${TERMPOOL_BASE_SUITE:-bookworm}"
PACKAGES="bash,tmux,python3,python3-pytest"

die() {
    echo "scripts/base_image.sh: $*" >&2
    exit 1
}

command -v docker >/dev/null 2>&1 || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot talk to the docker daemon (is dockerd running, are you root?)"

if [[ "${TERMPOOL_BASE_REBUILD:-0}" != 1 ]]; then
    if docker image inspect "$TAG" >/dev/null 2>&1; then
        echo "$TAG"
        exit 0
    fi
    for alias in $ALIASES; do
        if docker image inspect "$alias" >/dev/null 2>&1; then
            docker tag "$alias" "$TAG"
            echo "$TAG"
            exit 0
        fi
    done
fi

[[ "$(id -u)" == 0 ]] || die "must run as root (debootstrap needs it)"

# A rootfs counts as finished when debootstrap removed its work folder and the tools we
# need are there.
rootfs_complete() {
    local dir="$1"
    [[ -d "$dir" && ! -e "$dir/debootstrap" ]] || return 1
    [[ -x "$dir/bin/bash" && -x "$dir/usr/bin/tmux" && -x "$dir/usr/bin/python3" ]] || return 1
    [[ -d "$dir/usr/lib/python3/dist-packages/pytest" || -d "$dir/usr/lib/python3/dist-packages/_pytest" ]] || return 1
}

mkdir -p "$(dirname "$CACHE")"
# One builder at a time per cache folder; a second caller waits, then finds the image.
exec 9>"$CACHE.lock"
flock 9

if [[ "${TERMPOOL_BASE_REBUILD:-0}" != 1 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG"
    exit 0
fi

if [[ -n "${TERMPOOL_BASE_ROOTFS:-}" ]]; then
    ROOTFS="$TERMPOOL_BASE_ROOTFS"
    rootfs_complete "$ROOTFS" || die "TERMPOOL_BASE_ROOTFS=$ROOTFS is not a finished rootfs with bash, tmux, python3 and pytest"
else
    ROOTFS="$CACHE"
    if ! rootfs_complete "$ROOTFS" || [[ ! -e "$CACHE.ok" ]]; then
        if ! command -v debootstrap >/dev/null 2>&1; then
            log="$(mktemp)"
            if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap; } >"$log" 2>&1; then
                tail -n 40 "$log" >&2
                rm -f "$log"
                die "could not install debootstrap"
            fi
            rm -f "$log"
        fi
        # Bootstrap into a fresh folder beside the cache and move it into place only when
        # it is finished, so an interrupted run never leaves a half rootfs behind as "done".
        rm -f "$CACHE.ok"
        work="$(mktemp -d "$CACHE.tmp.XXXXXX")"
        log="$CACHE.debootstrap.log"
        if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work" "$MIRROR" >"$log" 2>&1; then
            tail -n 40 "$log" >&2
            rm -rf "$work"
            die "debootstrap failed (full log: $log)"
        fi
        rootfs_complete "$work" || { rm -rf "$work"; die "debootstrap finished but the rootfs lacks bash/tmux/python3/pytest"; }
        rm -rf "$CACHE"
        mv "$work" "$CACHE"
        touch "$CACHE.ok"
        rm -f "$log"
    fi
fi

# Leave out downloaded .debs, apt indexes and device nodes: docker provides /dev, and a
# task that needs apt runs `apt-get update` first anyway.
err="$(mktemp)"
trap 'rm -f "$err"' EXIT
if ! tar -C "$ROOTFS" --numeric-owner \
        --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
        --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/cache/apt/*.bin' \
        --exclude='./var/lib/apt/lists/*_Packages' --exclude='./var/lib/apt/lists/*_InRelease' \
        --exclude='./var/lib/apt/lists/*_Release' --exclude='./var/lib/apt/lists/*_Release.gpg' \
        -c . 2>"$err" \
    | docker import -c 'CMD ["bash"]' -c 'WORKDIR /' - "$TAG" >/dev/null 2>>"$err"; then
    cat "$err" >&2
    die "docker import of $ROOTFS as $TAG failed"
fi

docker image inspect "$TAG" >/dev/null 2>&1 || die "image $TAG is missing after import"
echo "$TAG"
