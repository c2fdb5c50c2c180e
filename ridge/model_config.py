"""Model configuration: `ModelConfig` is read from a HuggingFace `config.json` and normalises the
spellings that transformers 4.x and 5.x write (`rope_scaling`/`rope_theta` vs `rope_parameters`,
`torch_dtype` vs `dtype`, `num_experts` vs `num_local_experts`). A mixture-of-experts model's
routing is `ModelConfig.moe` (MoEConfig); everything else about it is the Llama family's.
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
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)

@dataclass(frozen=True)
class MoEConfig:
    """Routing of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE): `top_k` of
    `num_experts` experts of width `expert_size` per token, chosen by softmax over the router's
    logits, their weights renormalised to sum to 1 or not (`renormalize`: Qwen's norm_topk_prob;
    Mixtral always); `sparse_layers` are the layers whose MLP is the expert block (Qwen's
    decoder_sparse_step and mlp_only_layers), the others keep the dense MLP. Qwen2-MoE adds a shared
    expert of width `shared_expert_size` that every token runs, scaled by a sigmoid gate."""
    num_experts: int
    top_k: int
    expert_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]
    shared_expert_size: int = 0

    @classmethod
    def from_dict(cls, arch: str, raw: dict) -> "MoEConfig":
        num_experts = raw.get("num_experts") or raw.get("num_local_experts")
        top_k = raw.get("num_experts_per_tok")
        if not num_experts or not top_k or not 1 <= top_k <= num_experts:
            raise ValueError(f"model: {arch} needs num_experts (or num_local_experts) >= 1 and num_experts_per_tok "
                             f"in [1, num_experts]; config.json has {num_experts!r} and {top_k!r}")
        layers = range(raw["num_hidden_layers"])
        if arch == "MixtralForCausalLM":
            return cls(num_experts, top_k, raw["intermediate_size"], True, tuple(layers))
        step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
        if "moe_intermediate_size" not in raw:
            raise ValueError(f"model: config.json is missing 'moe_intermediate_size' ({arch})")
        return cls(num_experts, top_k, raw["moe_intermediate_size"], bool(raw.get("norm_topk_prob", False)),
                   tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
                   raw.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0)


MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


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
    quantization_config: dict | None = None   # config.json's, as written (AWQ, GPTQ, compressed-tensors)
    # the scheme the Linear layers are built with (ridge.layers.quant.int4.Int4Config), chosen by the
    # model loader from the `quantization` setting and quantization_config; None: float weights
    quant: object | None = None
    moe: MoEConfig | None = None              # routing, for a mixture-of-experts architecture

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
            qkv_bias=attention_bias or arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding,
            checkpoint_dtype=parse_dtype(dtype_name),
            bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
            quantization_config=raw.get("quantization_config"),
            moe=MoEConfig.from_dict(arch, raw) if arch in MOE_ARCHITECTURES else None,
        )


def _read_generation_config(path: str) -> dict | None:
    p = os.path.join(path, "generation_config.json")
    if os.path.isfile(p):
        with open(p) as f:
            return json.load(f)
    return None
