"""Make the wheelhouse that the Dockerfile installs from: wheels of requirements.txt (and of
pip itself) built on this host, so the image build never needs PyPI.

    python3 deploy/wheelhouse.py REQUIREMENTS OUTDIR TARGET_PYTHON_VERSION

`pip wheel` resolves for the Python that runs it. A dependency behind an environment marker
that holds only for the image's Python would be missing: redis needs async-timeout below
Python 3.11.3, and Debian bookworm's python3 is 3.11.2. So after `pip wheel`, walk the
requirement graph again with the markers evaluated for TARGET_PYTHON_VERSION (the base
image's `platform.python_version()`) and add whatever is missing, until nothing is.
Needs `packaging` (requirements-dev.txt) beside pip.
"""

from __future__ import annotations

import email.parser
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    sys.exit(
        "wheelhouse.py needs the packaging library: pip install -r requirements-dev.txt (or pip install packaging)"
    )


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def read_requirements(path: Path) -> list[Requirement]:
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            reqs.append(Requirement(line))
    return reqs


def wheels(outdir: Path) -> dict:
    """canonical project name -> (version, wheel path) of the wheels in outdir."""
    found = {}
    for whl in sorted(outdir.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(whl.name)
        found.setdefault(name, []).append((version, whl))
    return found


def requires_dist(whl: Path) -> list[Requirement]:
    with zipfile.ZipFile(whl) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(zf.read(meta).decode("utf-8"))
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def target_environment(version: str) -> dict:
    env = dict(default_environment())
    parts = version.split(".")
    env.update(python_full_version=version, python_version=".".join(parts[:2]), implementation_version=version)
    return env


def missing_for(roots: list[Requirement], outdir: Path, env: dict) -> list[str]:
    """Requirements that apply under env and that no wheel in outdir satisfies."""
    have = wheels(outdir)
    missing, seen = [], set()
    queue = [(req, "") for req in roots]
    while queue:
        req, extra = queue.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = (name, str(req.specifier), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        match = next(
            (whl for version, whl in have.get(name, []) if req.specifier.contains(version, prereleases=True)), None
        )
        if match is None:
            missing.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
            continue
        for dep in requires_dist(match):
            for dep_extra in ("", *sorted(req.extras)):
                queue.append((dep, dep_extra))
    return sorted(set(missing))


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        sys.exit(__doc__)
    requirements, outdir, target = Path(argv[0]), Path(argv[1]), argv[2]
    outdir.mkdir(parents=True, exist_ok=True)
    pip("wheel", "-q", "-r", str(requirements), "-w", str(outdir))
    import pip as pip_module  # the image runs pip from its wheel: no pip or ensurepip needed there

    pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(outdir), f"pip=={pip_module.__version__}")
    roots = read_requirements(requirements)
    env = target_environment(target)
    for _ in range(5):
        missing = missing_for(roots, outdir, env)
        if not missing:
            break
        print(f"wheelhouse.py: adding for Python {target}: {' '.join(missing)}", file=sys.stderr)
        pip("wheel", "-q", "-w", str(outdir), *missing)
    else:
        sys.exit(f"wheelhouse.py: still missing for Python {target}: {' '.join(missing)}")
    (outdir / "PYTHON_VERSION").write_text(".".join(target.split(".")[:2]) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
