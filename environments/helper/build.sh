#!/bin/sh
# Build tp-session, the static in-container session helper (see tp_session.c).
# Static, so the same binary runs in any task image (glibc, musl or none).
# Idempotent: rebuilds only when the binary is missing or older than its
# source; prints the binary's path on success.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
src="$here/tp_session.c"
out="$here/tp-session"
if [ -x "$out" ] && [ ! "$src" -nt "$out" ]; then
    echo "$out"
    exit 0
fi
if ! command -v gcc >/dev/null 2>&1; then
    echo "build.sh: gcc not found; install gcc and libc6-dev (static glibc) to build $out" >&2
    exit 1
fi
# Build under a temporary name and rename, so concurrent builds (several
# workers starting at once) never expose a half-written binary.
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT
gcc -O2 -static -s -Wall -Wextra -o "$tmp" "$src" -lutil
chmod 0755 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
echo "$out"
