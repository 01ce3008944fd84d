"""The README and the pages under docs/: every relative link resolves (the file, and the heading
an anchor names), nothing links outside the repository, the README stays a user's page, and
docs/README.md indexes every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devstack import ROOT

pytestmark = pytest.mark.unit

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = [*PAGES, ROOT / "bench" / "README.md", ROOT / "chaos" / "README.md", ROOT / "examples" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def headings(path: Path) -> list[str]:
    return [m.group(2) for line in prose(path.read_text()) if (m := HEADING.match(line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: formatting dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in prose(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        found += [a or b for a, b in LINK.findall(line)]
    return found


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.is_relative_to(ROOT) or "shared" in Path(file).parts:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_is_a_users_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    for command in ("scripts/serve.sh", "scripts/test.sh", "flask --app app dataset oracle"):
        assert command in (ROOT / "README.md").read_text(), command


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_heading_names_an_issue(page):
    named = [h for h in headings(page) if re.search(r"\bissues?\b|#\d+", h, re.IGNORECASE)]
    assert not named, f"{page.relative_to(ROOT)}: {named}"


def test_the_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t).resolve() for t in links(index) if not t.startswith("..")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    assert pages - listed == set(), "docs/README.md does not list these pages"


def test_the_slug_is_githubs():
    assert slug("Harbor's format (Terminal-Bench 2.0)") == "harbors-format-terminal-bench-20"
    assert slug("Running with `docker compose up`") == "running-with-docker-compose-up"
    assert slug("/status") == "status"
    assert slug("Probes, start-up and restarts") == "probes-start-up-and-restarts"
