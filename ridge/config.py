"""Engine and model configuration.

`ModelConfig` is read from a HuggingFace `config.json` and normalises the spellings that
transformers 4.x and 5.x write (`rope_scaling`/`rope_theta` vs `rope_parameters`,
`torch_dtype` vs `dtype`). `EngineConfig` holds the knobs of `LLM(...)`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {name!r}; expected one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    checkpoint_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model: no config.json in {path!r}")
        with open(cfg_path) as f:
            raw = json.load(f)
        return cls.from_dict(raw, generation_config=_read_generation_config(path))

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"ridge supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ValueError(f"model: config.json is missing {key!r}")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope = dict(raw.get("rope_parameters") or {})
        if raw.get("rope_scaling"):
            rope.update(raw["rope_scaling"])
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        sliding = raw.get("sliding_window")
        if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
            sliding = None
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        gen = generation_config or {}
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v biases; Llama-style configs switch them with attention_bias.
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding,
            checkpoint_dtype=parse_dtype(dtype_name),
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )


def _read_generation_config(path: str) -> dict | None:
    p = os.path.join(path, "generation_config.json")
    if os.path.isfile(p):
        with open(p) as f:
            return json.load(f)
    return None


@dataclass
class EngineConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    num_pages: int
    enable_prefix_caching: bool
    seed: int
    max_n: int
    enforce_eager: bool = False      # no CUDA graphs for decode (they are CUDA-only anyway)
    async_scheduling: bool = True    # overlap a decode step's host work with the previous step's GPU work
    attention_backend: str = "auto"
    load_format: str = "auto"
