"""docs/settings.md is generated from the settings classes (scripts/gen_settings_doc.py): a setting
added, renamed or re-documented without regenerating the page fails here."""
from __future__ import annotations

from pathlib import Path

import pytest

from ridge import settings
from ridge.config import EngineConfig

from tests.tests_support import REPO, load_script  # noqa: E402

ROOT = Path(REPO)


@pytest.fixture(scope="module")
def generator():
    return load_script(str(ROOT / "scripts" / "gen_settings_doc.py"))


def test_settings_page_is_current(generator):
    assert (ROOT / "docs" / "settings.md").read_text() == generator.page(), \
        "docs/settings.md is stale: run python3 scripts/gen_settings_doc.py"
    assert generator.main(["--check"]) == 0


def test_every_engine_setting_and_flag_is_on_the_page():
    text = (ROOT / "docs" / "settings.md").read_text()
    for f, s, _ in settings.fields(EngineConfig):
        assert f"| `{f.name}` | `{settings.flag_of(f, s)}`" in text, f.name
