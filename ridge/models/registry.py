"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from ridge.config import SUPPORTED_ARCHITECTURES


def model_class(architecture: str):
    from ridge.models.llama import LlamaForCausalLM

    registry = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}
    if architecture not in registry:
        raise ValueError(f"model: unsupported architecture {architecture!r}; ridge supports {', '.join(registry)}")
    return registry[architecture]
