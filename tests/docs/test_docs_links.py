"""Every relative link in README.md, BENCHMARKS.md and docs/ (the case study's own pages aside) points
at a file that exists, and an anchor at a heading or an `<a id>` of that file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.tests_support import REPO  # noqa: E402

ROOT = Path(REPO)
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if not p.relative_to(ROOT / "docs").as_posix().startswith("case-study-70b"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    return set(re.findall(r'<a id="([^"]+)"></a>', text)) | {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: no anchor #{anchor} in {dest.name}"
