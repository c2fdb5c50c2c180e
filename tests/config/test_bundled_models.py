"""Bundled checkpoints are named, not pathed: "demo-code-12m", "demo-code-3m" and the EAGLE-3 head
"demo-code-12m-eagle3" resolve beside ridge's own files from any working directory (and so from an
installed package), for the model and for the draft model or head alike; a name that is neither a
directory nor a bundled model is refused with the setting's name and the names that exist."""
from __future__ import annotations

import os

import pytest

from ridge.assets import ASSETS, bundled_models
from ridge.config import EngineConfig, model_dir


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_bundled_names_resolve_from_any_directory(elsewhere):
    assert {"demo-code-12m", "demo-code-3m", "demo-code-12m-eagle3"} <= set(bundled_models())
    for name in ("demo-code-12m", "demo-code-3m", "demo-code-12m-eagle3"):
        assert not os.path.exists(name)
        assert model_dir(name) == os.path.join(ASSETS, name)
    assert model_dir(None) == os.path.join(ASSETS, "demo-code-12m")


def test_a_directory_is_taken_before_a_bundled_name(elsewhere):
    (elsewhere / "demo-code-3m").mkdir()
    assert model_dir("demo-code-3m") == "demo-code-3m"


def test_an_unknown_name_names_the_bundled_models(elsewhere):
    with pytest.raises(ValueError, match=r"^model: 'no-such-model' is neither a directory "
                       r".*demo-code-12m, demo-code-12m-eagle3, demo-code-3m"):
        model_dir("no-such-model")


def test_model_and_draft_model_by_name_resolve_together(elsewhere):
    cfg = EngineConfig.from_kwargs(model="demo-code-12m", device="cpu",
                                   speculative_config={"method": "draft_model", "model": "demo-code-3m",
                                                       "num_speculative_tokens": 3})
    resolved, model_cfg = cfg.resolve()
    assert resolved.model == os.path.join(ASSETS, "demo-code-12m")
    bad = EngineConfig.from_kwargs(model="demo-code-12m", device="cpu",
                                   speculative_config={"method": "draft_model", "model": "demo-code-3",
                                                       "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="^model: 'demo-code-3' is neither"):
        bad.resolve()
