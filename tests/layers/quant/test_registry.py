"""The registry is the only place a `quantization` value becomes a method; the setting's choices
(ridge/config.py, which sits below the layers and cannot import them) must be exactly the values
the registry knows, so a method added in one place and not the other fails here."""
import pytest

from ridge import settings
from ridge.config import EngineConfig
from ridge.layers.quant import registry


def test_the_settings_choices_are_the_registrys_methods():
    (meta,) = [s for f, s, _ in settings.fields(EngineConfig) if f.name == "quantization"]
    assert meta.choices is not None and sorted(meta.choices) == sorted(registry.QUANTIZATIONS)


def test_an_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization: must be one of"):
        registry.select_quantization("nvfp4", None)
