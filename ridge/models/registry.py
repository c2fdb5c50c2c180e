"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from ridge.model_config import EAGLE3_ARCHITECTURES, MTP_ARCHITECTURE, SUPPORTED_ARCHITECTURES


def model_class(architecture: str):
    from ridge.models.eagle3 import Eagle3ForCausalLM
    from ridge.models.llama import LlamaForCausalLM
    from ridge.models.mtp import DeepSeekMTP

    if architecture in EAGLE3_ARCHITECTURES:
        return Eagle3ForCausalLM
    if architecture == MTP_ARCHITECTURE:
        return DeepSeekMTP
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: unsupported architecture {architecture!r}; "
                         f"ridge supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return LlamaForCausalLM
