#!/usr/bin/env bash
# A Python >= 3.12 venv (Harbor's own requirement; the server stays on the machine's Python)
# with Harbor from PyPI and termpool's client installed from this checkout (editable, so it
# follows the checkout): what `harbor run -e termpool.harbor:TermpoolEnvironment` and the tests
# that run Harbor need. Idempotent: nothing is installed again while the checkout, requirements-harbor.txt and
# pyproject.toml are unchanged. Prints the venv's path.
#   HARBOR_VENV   where (default: .harbor-venv in the checkout)
#   HARBOR_PYTHON which interpreter (default: the first python3.13/python3.12 that runs, then
#                 pyenv's 3.12+ versions)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HARBOR_VENV:-$PWD/.harbor-venv}

runs_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
  local candidate
  for candidate in ${HARBOR_PYTHON:-} python3.13 python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    if [ -n "$candidate" ] && runs_312 "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  echo "harbor-venv: no Python >= 3.12 found (Harbor needs one); set HARBOR_PYTHON" >&2
  exit 3
}

stamp=$( (pwd; cat requirements-harbor.txt pyproject.toml) | sha256sum | cut -c1-16)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.termpool-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$venv"
  exit 0
fi
find_python >/dev/null  # exits 3 when there is none
python=$(find_python)
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[harbor]' >&2
echo "$stamp" >"$venv/.termpool-stamp"
echo "$venv"
