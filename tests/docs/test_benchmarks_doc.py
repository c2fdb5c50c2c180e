"""BENCHMARKS.md is generated from docs/benchmarks/current.json (scripts/gen_benchmarks_doc.py):
it must be current, at most 200 lines, and every figure must name its device, date, command, peer
and ratio and link to a journal entry and a raw file that exist."""
from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from tests.tests_support import REPO, load_script  # noqa: E402

ROOT = Path(REPO)


@pytest.fixture(scope="module")
def generator():
    return load_script(str(ROOT / "scripts" / "gen_benchmarks_doc.py"))


def test_benchmarks_page_is_current_and_short(generator):
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert text == generator.page(), "BENCHMARKS.md is stale: run python3 scripts/gen_benchmarks_doc.py"
    assert len(text.splitlines()) <= 200


def test_every_figure_has_its_provenance(generator):
    rows = [r for s in generator.load()["sections"] for r in s["rows"]]
    assert rows
    for r in rows:
        assert set(generator.FIELDS) <= set(r) <= {*generator.FIELDS, "headline"}, r
        assert all(str(r[f]).strip() for f in generator.FIELDS), r
        datetime.date.fromisoformat(r["date"])
        assert (ROOT / r["raw"]).exists(), f"{r['what']}: raw file {r['raw']} is missing"
        page, anchor = r["journal"].split("#")
        journal = ROOT / "docs" / "benchmarks" / page
        assert journal.exists(), r["journal"]
        entry = re.search(rf'<a id="{re.escape(anchor)}"></a>\n## (.*)\n', journal.read_text())
        assert entry, f"{r['what']}: no entry {r['journal']}"
        assert r["date"] in entry.group(1) or r["date"] in journal.read_text().split(f'id="{anchor}"')[1][:2000]


def test_journal_headings_say_what_where_when():
    """A journal heading names what was measured, the device and the date; no bookkeeping."""
    for page in sorted((ROOT / "docs" / "benchmarks").glob("*.md")):
        for heading in re.findall(r"^## (.*)$", page.read_text(), re.M):
            assert not re.search(r"\bsession\b|\bround \w+ follow-up|\(issue \d+", heading, re.I), (page.name, heading)
            if not page.name.endswith("-notes.md"):
                assert re.search(r"— .+, \d{4}-\d\d-\d\d$", heading), (page.name, heading)


def test_readme_headline_table_is_current(generator):
    text = (ROOT / "README.md").read_text()
    assert text == generator.readme(text), "README.md's headline table is stale: run python3 scripts/gen_benchmarks_doc.py"
    assert generator.headline().count("\n") >= 5
