"""Model configuration: `ModelConfig` is read from a HuggingFace `config.json` and normalises the
spellings that transformers 4.x and 5.x write (`rope_scaling`/`rope_theta` vs `rope_parameters`,
`torch_dtype` vs `dtype`, `num_experts` vs `num_local_experts`). A mixture-of-experts model's
routing is `ModelConfig.moe` (MoEConfig); everything else about it is the Llama family's.
"""
from __future__ import annotations

import dataclasses
import json
import math
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
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# EAGLE-3 draft heads (docs/eagle3-design.md): the original layout's names (vLLM maps both) and the
# speculators library's; a head is loaded only as a speculative_config model, never as the model
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# DeepSeek-V3's multi-token-prediction layer run as a draft head (vLLM's name): made from the target's
# own config (ModelConfig.mtp_head), never read from a config.json
MTP_ARCHITECTURE = "DeepSeekMTPModel"

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
    shared_expert_gated: bool = True    # Qwen2-MoE's sigmoid gate on the shared expert; DeepSeek has none
    # DeepSeek's routing (ridge/kernels/moe_route.py: route_grouped_ref): None is plain softmax top-k
    grouped: "GroupedRouting | None" = None

    @classmethod
    def from_dict(cls, arch: str, raw: dict) -> "MoEConfig":
        if arch in DEEPSEEK_ARCHITECTURES:
            return cls.from_deepseek(arch, raw)
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


    @classmethod
    def from_deepseek(cls, arch: str, raw: dict) -> "MoEConfig":
        """DeepSeek-V2/V3: n_routed_experts of width moe_intermediate_size, n_shared_experts of the
        same width run by every token (one MLP n_shared_experts times as wide, ungated), MoE from
        layer first_k_dense_replace on. V2 scores by softmax, V3 by
        sigmoid plus a learnt per-expert bias used only to choose; both may first keep the
        topk_group best of n_group expert groups; the weights are scaled by routed_scaling_factor."""
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not raw.get(key):
                raise ValueError(f"model: {arch} config.json needs {key!r} >= 1")
        E, k = raw["n_routed_experts"], raw["num_experts_per_tok"]
        v3 = arch == "DeepseekV3ForCausalLM"
        if v3:          # transformers' DeepseekV3Config defaults, for keys a config.json leaves out
            raw = {"norm_topk_prob": True, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                   "routed_scaling_factor": 2.5, **{k: v for k, v in raw.items() if v is not None}}
        grouped = v3 or raw.get("topk_method", "greedy") == "group_limited_greedy"
        n_group, topk_group = (raw.get("n_group") or 1, raw.get("topk_group") or 1) if grouped else (1, 1)
        if not 1 <= k <= E or E % n_group or not 1 <= topk_group <= n_group or k > topk_group * E // n_group:
            raise ValueError(f"model: {arch} routing does not fit: {E} experts, top {k}, {n_group} groups of which "
                             f"{topk_group} are kept")
        routing = GroupedRouting("sigmoid" if v3 else "softmax", n_group, topk_group, "top2" if v3 else "max",
                                 float(raw.get("routed_scaling_factor", 1.0)), v3)
        first = raw.get("first_k_dense_replace", 0) or 0
        size = raw["moe_intermediate_size"]       # V2's router never renormalises (as transformers runs it)
        # the multi-token-prediction layers after the last decoder layer are sparse as its index says
        last = raw["num_hidden_layers"] + (raw.get("num_nextn_predict_layers") or 0)
        return cls(E, k, size, v3 and bool(raw.get("norm_topk_prob", False)), tuple(range(first, last)),
                   size * (raw.get("n_shared_experts") or 0), shared_expert_gated=False, grouped=routing)


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router: `scoring` softmax (V2) or sigmoid (V3, with a learnt `score_bias` that
    only chooses); the tokens pick among the `topk_group` best of `n_group` expert groups (a
    group's score: its best expert's, or its two best summed: `group_score` max / top2); the
    chosen weights (renormalised if MoEConfig.renormalize) times `scale`."""
    scoring: str
    n_group: int
    topk_group: int
    group_score: str
    scale: float
    score_bias: bool


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's Multi-head Latent Attention: q from hidden (q_lora_rank None) or through a rank
    q_lora_rank bottleneck; K and V of every head come up (kv_b_proj) from one kv_lora_rank latent
    per token, plus one shared rotary key of qk_rope_head_dim. A query head is qk_nope_head_dim +
    qk_rope_head_dim wide, a value head v_head_dim. The cache holds the latent and the rotary key.
    `rope_interleaved`: the checkpoint's rotary dims are pairs (x0, x1), (x2, x3) (V2 always, V3's
    rope_interleave); ridge de-interleaves those rows at load and rotates half-split."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool
    softmax_scale: float

    @classmethod
    def from_dict(cls, arch: str, raw: dict, rope_scaling: dict | None) -> "MLAConfig":
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not raw.get(key):
                raise ValueError(f"model: {arch} config.json needs {key!r} >= 1")
        if raw["qk_rope_head_dim"] % 2:
            raise ValueError(f"model: qk_rope_head_dim must be even, got {raw['qk_rope_head_dim']}")
        scale = (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]) ** -0.5
        if rope_scaling and rope_scaling.get("mscale_all_dim"):     # YaRN's attention temperature, as HF applies it
            factor = rope_scaling["factor"]
            m = 0.1 * rope_scaling["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        interleaved = arch == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True))
        return cls(raw.get("q_lora_rank"), raw["kv_lora_rank"], raw["qk_nope_head_dim"], raw["qk_rope_head_dim"],
                   raw["v_head_dim"], interleaved, scale)


@dataclass(frozen=True)
class Eagle3Config:
    """What makes an EAGLE-3 head's config.json more than a one-layer Llama's: `draft_vocab_size`
    (its LM head's rows; d2t maps them to target ids), `target_hidden_size` (the width of each of
    the target's captured states; fc reads their concatenation), `aux_layer_ids` (the target
    layers whose input stream is captured; None: the target's default, (2, L // 2, L - 3)) and
    `norm_before_residual` (the speculators library's variant: the fused state is normalised
    before it becomes the residual). The speculators layout nests the Llama keys in
    `transformer_layer_config` and defaults norm_before_residual to true, as vLLM reads it."""
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool

    num_aux = property(lambda self: len(self.aux_layer_ids) if self.aux_layer_ids is not None else 3)

    @staticmethod
    def flatten(raw: dict) -> dict:
        """A speculators config's Llama keys brought to the top (its own keys win)."""
        layer = raw.get("transformer_layer_config")
        return {**layer, **{k: v for k, v in raw.items() if k != "transformer_layer_config"}} \
            if isinstance(layer, dict) else raw

    @classmethod
    def from_dict(cls, raw: dict) -> "Eagle3Config":
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"model: eagle_config must be an object, got {eagle!r}")
        if not eagle.get("use_aux_hidden_state", True):
            raise ValueError("model: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 head reading the "
                             "target's last state); ridge runs EAGLE-3 heads, which read three captured layers")
        if raw["num_hidden_layers"] != 1:
            raise ValueError(f"model: num_hidden_layers of an EAGLE-3 head must be 1 (ridge runs one-layer heads), "
                             f"got {raw['num_hidden_layers']}")
        vocab, hidden = raw["vocab_size"], raw["hidden_size"]
        draft_vocab = raw.get("draft_vocab_size") or vocab
        if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab:
            raise ValueError(f"model: draft_vocab_size must be an integer in [1, vocab_size={vocab}], got {draft_vocab!r}")
        target_hidden = raw.get("target_hidden_size") or hidden
        ids = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"model: eagle_aux_hidden_state_layer_ids must be a list of layer ids >= 0, got {ids!r}")
        speculators = "transformer_layer_config" in raw or "speculators_model_type" in raw
        return cls(draft_vocab, target_hidden, tuple(ids) if ids is not None else None,
                   bool(raw.get("norm_before_residual", speculators)))

    def layer_ids(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input stream the head reads (id L: the stream after the last)."""
        return self.aux_layer_ids if self.aux_layer_ids is not None else \
            (2, target_layers // 2, target_layers - 3)

    def check_target(self, head: "ModelConfig", target: "ModelConfig") -> None:
        """ValueError naming the key where this head cannot draft for `target`."""
        if head.vocab_size != target.vocab_size:
            raise ValueError(f"vocab_size: the EAGLE-3 head's ({head.vocab_size}) must be the target's "
                             f"({target.vocab_size}); draft_vocab_size is its own")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"target_hidden_size: the EAGLE-3 head reads states {self.target_hidden_size} wide, "
                             f"the target's hidden_size is {target.hidden_size}")
        if head.hidden_size != target.hidden_size:
            raise ValueError(f"hidden_size: the EAGLE-3 head's ({head.hidden_size}) must be the target's "
                             f"({target.hidden_size}): it embeds its tokens with the target's table")
        ids = self.layer_ids(target.num_layers)
        if min(ids) < 0 or max(ids) > target.num_layers:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: {list(ids)} must lie in [0, {target.num_layers}] "
                             f"(the target's layers; {target.num_layers}: after the last)")


MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") + DEEPSEEK_ARCHITECTURES


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
    moe: MoEConfig | None = None              # routing, for a mixture-of-experts architecture
    mla: MLAConfig | None = None              # DeepSeek's latent attention (head_dim: its rotary part)
    eagle: Eagle3Config | None = None         # an EAGLE-3 draft head's own keys
    num_nextn_predict_layers: int = 0         # DeepSeek-V3's multi-token-prediction layers after the last one
    mtp_layer: int | None = None              # an MTP head's: the checkpoint layer it runs (mtp_head)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def cache_row(self) -> tuple[int, int, int]:
        """(streams, heads, width) of a token's cached row in one layer: K and V per kv head, or
        MLA's one latent + rotary key."""
        if self.mla is not None:
            return 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def mtp_head(self) -> "ModelConfig":
        """The config of this target's first multi-token-prediction layer run as a draft head (one
        decoder layer, checkpoint layer num_hidden_layers, in the target's own checkpoint);
        ValueError where the target has none."""
        if self.mla is None:
            raise ValueError(f"method 'mtp' drafts with a DeepSeek-V3-style model's own multi-token-prediction "
                             f"layers; {self.architecture} has none (use eagle3, draft_model, ngram or suffix)")
        if self.num_nextn_predict_layers < 1:
            raise ValueError(f"method 'mtp': the target's config.json has no multi-token-prediction layers "
                             f"(num_nextn_predict_layers is {self.num_nextn_predict_layers})")
        return dataclasses.replace(self, architecture=MTP_ARCHITECTURE, num_layers=1, mtp_layer=self.num_layers,
                                   num_nextn_predict_layers=0)

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
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES + EAGLE3_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"ridge supports {', '.join(SUPPORTED_ARCHITECTURES)} (and EAGLE-3 heads as draft models)"
            )
        if arch in EAGLE3_ARCHITECTURES:
            raw = Eagle3Config.flatten(raw)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ValueError(f"model: config.json is missing {key!r}")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        if arch in DEEPSEEK_ARCHITECTURES:          # rotary width; every head reads the one latent
            head_dim, raw = raw.get("qk_rope_head_dim") or head_dim, {**raw, "num_key_value_heads": num_heads}
        rope = dict(raw.get("rope_parameters") or {})
        if raw.get("rope_scaling"):
            rope.update(raw["rope_scaling"])
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_type == "yarn":
            if not rope.get("original_max_position_embeddings"):
                raise ValueError("model: yarn rope scaling needs 'original_max_position_embeddings' in config.json")
            if rope_scaling.get("factor") is None:      # as transformers infers it
                rope_scaling["factor"] = (raw.get("max_position_embeddings", 2048)
                                          / rope["original_max_position_embeddings"])
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
            mla=MLAConfig.from_dict(arch, raw, rope_scaling) if arch in DEEPSEEK_ARCHITECTURES else None,
            eagle=Eagle3Config.from_dict(raw) if arch in EAGLE3_ARCHITECTURES else None,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0) if arch in DEEPSEEK_ARCHITECTURES
            else 0,
        )


def _read_generation_config(path: str) -> dict | None:
    p = os.path.join(path, "generation_config.json")
    if os.path.isfile(p):
        with open(p) as f:
            return json.load(f)
    return None
