"""The Llama family: Llama 1/2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), and
their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (`cfg.moe`: the sparse layers' MLP is
ridge/models/moe.py's block); DeepSeek-V2/V3 are the same decoder with latent attention (`cfg.mla`:
ridge/models/mla.py) and DeepSeek's routing, in one file: the differences are flags on ModelConfig, not copies of
the model. Module and parameter names follow the HF checkpoints except the merged projections
(`qkv_proj`, `gate_up_proj`, and each layer's experts as two tensors): `checkpoint_slot` tells the
loader which parameter and shard a checkpoint tensor goes to; the parameter's own weight_loader
puts it in place. The quantization method (`quant`, made by ridge/layers/quant/registry.py at load)
goes to the projections and experts; the embeddings and the LM head stay in the activation dtype.

The forward pass works on one flat batch of tokens ([T, hidden]) from many sequences: prefill
chunks and decode tokens side by side; only attention needs to know where sequences begin.
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.kernels.attention_meta import AttentionMetadata
from ridge.layers.attention import Attention, AttentionBackend, rank_heads
from ridge.layers.cost import OpCost, StepShape, all_gather_cost, all_reduce_cost, child, gemm_cost, precision_of
from ridge.layers.embedding import VocabTable
from ridge.layers.linear import Linear, wire_producer
from ridge.layers.mlp import GatedMLP
from ridge.layers.norm import RMSNorm
from ridge.layers.quant.base import QuantConfig
from ridge.layers.rotary import RotaryEmbedding
from ridge.layers.sampler import sampling_cost
from ridge.models.mla import MLAttention
from ridge.models.moe import SparseMoeBlock
from ridge.parallel import SINGLE, TensorParallel

# checkpoint projection name -> (ridge merged module, shard)
CHECKPOINT_NAME_MAP = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                       "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
# an expert's projection (HF's names and Mixtral's) -> (the experts' merged parameter, part)
EXPERT_NAME_MAP = {"gate_proj": ("w13_weight", "gate"), "up_proj": ("w13_weight", "up"), "down_proj": ("w2_weight", ""),
                   "w1": ("w13_weight", "gate"), "w3": ("w13_weight", "up"), "w2": ("w2_weight", "")}

# module names of other checkpoints -> ridge's (Mixtral's sparse block, DeepSeek's shared experts)
RENAMED = {"block_sparse_moe": "mlp", "shared_experts": "shared_expert"}
# capture_layers' id of the final norm's output (what the LM head reads; an MTP head's input)
NORMED = -1


def layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to ("model.layers.<i>...."), else -1."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


class LlamaAttention(nn.Module):
    """Under tensor parallelism this rank's query heads and the KV heads they read (rank_heads):
    qkv_proj is column-parallel by heads, o_proj row-parallel over the same heads."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, in_features: int | None = None):
        """in_features: the width qkv_proj reads (default hidden_size; an EAGLE-3 head's is 2 x hidden)."""
        super().__init__()
        self.cfg, d = cfg, cfg.head_dim
        self.heads, self.kv_heads, first_q, first_kv = rank_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        kv_rows = (first_kv * d, self.kv_heads * d)
        self.qkv_proj = Linear(in_features or cfg.hidden_size, {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
                               bias=cfg.qkv_bias, quant=quant, tp=tp, parallel="column",
                               slices={"q": (first_q * d, self.heads * d), "k": kv_rows, "v": kv_rows})
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, quant=quant, tp=tp, parallel="row")
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # rotary is applied by attn, in the same backend call (one kernel) as the KV-cache write
        self.attn = Attention(self.heads, self.kv_heads, cfg.head_dim, cfg.sliding_window, backend, rotary)

    @property
    def input_proj(self) -> Linear:
        """The one projection reading the block's input (the norm before it may hand it quantized)."""
        return self.qkv_proj

    def _qkv(self, x):
        d, q_size, kv_size = self.cfg.head_dim, self.heads * self.cfg.head_dim, self.kv_heads * self.cfg.head_dim
        q, k, v = (t.view(-1, n, d) for t, n in zip(self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1),
                                                    (self.heads, self.kv_heads, self.kv_heads)))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        q, k, v = self._qkv(x)
        return self.o_proj(self.attn(positions, q, k, v, kv_cache, meta).view(-1, q.shape[1] * q.shape[2]))

    def write_kv(self, positions, x, kv_cache, slot_mapping: torch.Tensor) -> None:
        """The cache entries of x's rows, without attending (Attention.write_kv)."""
        self.attn.write_kv(positions, *self._qkv(x), kv_cache, slot_mapping)

    def cost(self, step: StepShape) -> list[OpCost]:
        out = child("qkv_proj", self.qkv_proj.cost(step, name="qkv_proj"))
        if self.cfg.qk_norm:
            out += [c for n, h in (("q_norm", self.heads), ("k_norm", self.kv_heads))
                    for c in child(n, getattr(self, n).cost(step, step.num_tokens * h), "qk_norm")]
        return out + child("attn", self.attn.cost(step)) + child("o_proj", self.o_proj.cost(step, name="o_proj"))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, index: int,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None):
        super().__init__()
        self.self_attn = (MLAttention(cfg, rotary, backend, quant) if cfg.mla is not None
                          else LlamaAttention(cfg, rotary, backend, tp, quant))
        self.mlp = SparseMoeBlock(cfg, tp, quant) if cfg.moe is not None and index in cfg.moe.sparse_layers else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, quant, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # each norm hands its block's input projection its output, quantized where that projection's
        # method reads a quantized activation the norm's kernel can write (ridge/layers/norm.py)
        for norm, block in ((self.input_layernorm, self.self_attn), (self.post_attention_layernorm, self.mlp)):
            if block.input_proj is not None:
                wire_producer(norm, block.input_proj)

    def forward(self, positions, x, residual, kv_cache, meta):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def cost(self, step: StepShape, first: bool = False) -> list[OpCost]:
        """The first layer's input norm has no residual yet."""
        return (child("input_layernorm", self.input_layernorm.cost(step, residual=not first))
                + child("self_attn", self.self_attn.cost(step))
                + child("post_attention_layernorm", self.post_attention_layernorm.cost(step, residual=True))
                + child("mlp", self.mlp.cost(step)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int, tp: TensorParallel = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__()
        self.embed_tokens = VocabTable(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, backend, i, tp, quant)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # layer id -> the column blocks of `captured` its input stream goes to (capture_layers); empty:
        # nothing is captured and the forward pays one dict test a layer
        self.captures: dict[int, list[int]] = {}
        self.captured: torch.Tensor | None = None

    def capture_layers(self, layer_ids: tuple[int, ...], out: torch.Tensor) -> None:
        """From now on every forward writes the residual stream entering layer i (x + residual, before
        any norm: transformers' hidden_states[i]; i = num_layers: after the last layer; NORMED: the
        final norm's output) of each id in layer_ids into rows [0, T) of `out` [rows,
        len(layer_ids) * hidden], block s for layer_ids[s]. `out` is a fixed buffer, so the decode
        and verify CUDA graphs capture the writes as they are (an EAGLE-3 head reads them,
        docs/eagle3-design.md; an MTP head the normed output)."""
        self.captures = {}
        for slot, i in enumerate(layer_ids):
            self.captures.setdefault(i, []).append(slot)
        self.captured = out

    def _capture(self, i: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        T, H = x.shape[0], x.shape[-1]
        if T > self.captured.shape[0]:
            raise RuntimeError(f"capture_layers: a step of {T} tokens, the buffer holds {self.captured.shape[0]}")
        for slot in self.captures.get(i, ()):
            out = self.captured[:T, slot * H:(slot + 1) * H]
            if residual is None:
                out.copy_(x)
            else:
                torch.add(x, residual, out=out)

    def forward(self, input_ids, positions, kv_caches, meta):
        x, residual = self.embed_tokens(input_ids), None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if self.captures:
                self._capture(i, x, residual)
            x, residual = layer(positions, x, residual, kv_cache, meta)
        if self.captures:
            self._capture(len(self.layers), x, residual)
        out = self.norm(x, residual)[0]
        if NORMED in self.captures:
            self._capture(NORMED, out, None)
        return out

    def cost(self, step: StepShape) -> list[OpCost]:
        w, T = self.embed_tokens.weight, step.num_tokens
        row = w.shape[1] * w.element_size()                 # one table row read and written per token
        out = [OpCost("embed", "embedding", 0, 2 * T * row, T * row, compute=step.act.compute, module="embed_tokens")]
        # vocab-parallel: each token's row comes from the rank holding it, zeros from the others, summed
        out += child("embed_tokens", all_reduce_cost("embed.all_reduce", T, w.shape[1], step, self.embed_tokens.tp.size))
        for i, layer in enumerate(self.layers):
            out += child(f"layers.{i}", layer.cost(step, first=i == 0))
        blocks = sum(map(len, self.captures.values()))
        if blocks:          # capture_layers: x + residual read, the sum written, per captured block
            out.append(OpCost("capture", "elementwise", T * row * blocks / w.element_size(), 3 * T * row * blocks,
                              compute=step.act.compute, module="captured"))
        # the final norm's residual output is never read, so it is not written
        return out + child("norm", self.norm.cost(step, residual=True, residual_out=False), "final_norm")


class LlamaForCausalLM(nn.Module):
    checkpoint_name_map = CHECKPOINT_NAME_MAP

    def checkpoint_slot(self, name: str) -> tuple[str | None, str | None]:
        """A checkpoint tensor's (ridge parameter name, shard id or None). DeepSeek's attention
        projections keep their own names (MLA merges none of them); DeepSeek-V3's multi-token-prediction
        layers after the last decoder layer are not the model's (None: transformers skips them too)."""
        if self.cfg.mla is not None and layer_index(name) >= self.cfg.num_layers:
            return None, None
        parts = [RENAMED.get(p, p) for p in name.split(".")]
        if self.cfg.mla is not None and "self_attn" in parts:
            return ".".join(parts), None
        if "experts" in parts:
            i = parts.index("experts")
            if len(parts) == i + 4 and parts[i + 1].isdigit() and parts[i + 2] in EXPERT_NAME_MAP:
                param, part = EXPERT_NAME_MAP[parts[i + 2]]
                return ".".join(parts[:i + 1] + [param]), f"{parts[i + 1]}.{part}" if part else parts[i + 1]
        for i, part in enumerate(parts):
            if part in CHECKPOINT_NAME_MAP:
                merged, shard = CHECKPOINT_NAME_MAP[part]
                return ".".join(parts[:i] + [merged] + parts[i + 1:]), shard
        return ".".join(parts), None

    @staticmethod
    def checkpoint_name(param: str, shard: str | None) -> str:
        """The HF checkpoint name of a parameter's shard (for messages about missing tensors)."""
        if shard is None:
            return param
        parent, merged, leaf = param.rsplit(".", 2)
        if leaf in ("w13_weight", "w2_weight"):
            expert, _, part = shard.partition(".")
            return f"{parent}.{merged}.{expert}.{part + '_proj' if part else 'down_proj'}.weight"
        return f"{parent}.{next(k for k, v in CHECKPOINT_NAME_MAP.items() if v == (merged, shard))}.{leaf}"

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int, tp: TensorParallel = SINGLE,
                 quant: QuantConfig | None = None):
        """quant: the quantization method the projections and experts are built with (None: the model's dtype)."""
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, backend, max_position, tp, quant)
        if not cfg.tie_word_embeddings:
            self.lm_head = VocabTable(cfg.vocab_size, cfg.hidden_size, tp)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Hidden states [T, hidden] for every token of the flat batch."""
        return self.model(input_ids, positions, kv_caches, meta)

    @property
    def head(self) -> VocabTable:               # the embedding table when the two are tied
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32 (every rank's vocabulary share gathered)."""
        return self.head.logits(hidden)

    def cost(self, step: StepShape) -> list[OpCost]:
        """Every op of one step, in order: the layers, the LM head over the rows that sample
        (float32 logits; kept in the model's dtype under a what-if weight format; vocab-parallel: this
        rank's share of the vocabulary, then the all-gather of every rank's logits), sampling."""
        w, ranks = self.head.weight, self.head.tp.size
        head = [gemm_cost("lm_head", step.sampled_rows, w, None, precision_of(w.dtype), step, out_bytes=4)]
        head += all_gather_cost("lm_head.all_gather", step.sampled_rows, w.shape[0], w.element_size(), ranks)
        return child("model", self.model.cost(step)) + head + [sampling_cost(step, self.cfg.vocab_size)]
