"""The layout rules of docs/development.md, checked on the repo's own Python files with `ast`:
no module imports another module's private (underscore) names, module-level imports form no
circle, and no module is over MAX_LINES lines. Task fixtures (tests/fixtures: graders that run
inside task containers) are not the repo's modules."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "app",
    "bench",
    "chaos",
    "cli",
    "deploy",
    "devstack",
    "environments",
    "examples",
    "poolcore",
    "tasks",
    "termpool",
    "tests",
)
SKIPPED = (ROOT / "tests" / "fixtures",)
MAX_LINES = 500

pytestmark = pytest.mark.unit


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def repo_modules() -> dict[str, Path]:
    """Every Python module of the repo's packages, by dotted name."""
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    return {module_name(p): p for p in paths if not any(p.is_relative_to(s) for s in SKIPPED)}


MODULES = repo_modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module a `from ... import` reads (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def module_aliases(module: str, tree: ast.Module) -> dict[str, str]:
    """Local names bound to a repo module anywhere in `tree` (`import a.b as c`, `from a import b`)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    aliases[alias.asname] = alias.name
                elif not alias.asname:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else [*inner, node.attr]
    return None


def private_uses(module: str, tree: ast.Module) -> list[str]:
    """Where `module` reads an underscore name of another repo module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imported_from(module, node)
            if base in MODULES and base != module:
                found += [f"line {node.lineno}: from {base} import {a.name}" for a in node.names if private(a.name)]
    aliases = module_aliases(module, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain = dotted(node.value)
            if chain and chain[0] in aliases:
                owner = ".".join([aliases[chain[0]], *chain[1:]])
                if owner in MODULES and owner != module:
                    found.append(f"line {node.lineno}: {owner}.{node.attr}")
        elif isinstance(node, ast.Call):
            found += patched_private(module, node, aliases)
    return found


def patched_private(module: str, call: ast.Call, aliases: dict[str, str]) -> list[str]:
    """A private name of another module patched by name: `setattr(mod, "_y", ...)`,
    `mock.patch.object(mod, "_y")`, `monkeypatch.setattr("pkg.mod._y", ...)`."""
    args = call.args
    if len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
        chain = dotted(args[0])
        if chain and chain[0] in aliases and private(args[1].value):
            owner = ".".join([aliases[chain[0]], *chain[1:]])
            if owner in MODULES and owner != module:
                return [f"line {call.lineno}: {owner}.{args[1].value} (patched)"]
    if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        owner, _, name = args[0].value.rpartition(".")
        if owner in MODULES and owner != module and private(name):
            return [f"line {call.lineno}: {args[0].value} (patched)"]
    return []


def module_level_imports(module: str, tree: ast.Module) -> set[str]:
    """The repo modules `module` imports when it is imported (statements outside functions)."""
    targets = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(module, node)
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
        stack.extend(ast.iter_child_nodes(node))
    return {target for target in targets if target in MODULES and target != module}


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


def test_no_module_imports_another_modules_private_names():
    found = [f"{MODULES[m].relative_to(ROOT)} {use}" for m, tree in TREES.items() for use in private_uses(m, tree)]
    assert not found, "give what modules share a public name:\n" + "\n".join(found)


def test_module_level_imports_form_no_circle():
    graph = {module: module_level_imports(module, tree) for module, tree in TREES.items()}
    circle = import_circle(graph)
    assert circle is None, "an import circle: " + " -> ".join(reversed(circle))


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by subject, each module at most {MAX_LINES} lines: {long}"


# ---- the checks themselves, on made-up modules -------------------------------------------------
def test_the_checks_see_what_they_are_for():
    tree = ast.parse("from tasks.run_jobs import _job, RETRY\nimport poolcore.dispatch as d\nd._start_steps()\n")
    assert private_uses("tasks.episode", tree) == [
        "line 1: from tasks.run_jobs import _job",
        "line 3: poolcore.dispatch._start_steps",
    ]
    assert private_uses("tasks.run_jobs", ast.parse("from tasks.run_jobs import _job\n")) == []
    patched = 'from tasks import warm_pool\nmonkeypatch.setattr(warm_pool, "_x", 1)\nmock.patch("tasks.warm_pool._y")\n'
    assert private_uses("tests.test_x", ast.parse(patched)) == [
        "line 2: tasks.warm_pool._x (patched)",
        "line 3: tasks.warm_pool._y (patched)",
    ]
    nested = ast.parse("if True:\n    from poolcore import config\ndef f():\n    import tasks.run_jobs\n")
    assert module_level_imports("poolcore.dispatch", nested) == {"poolcore.config"}
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
