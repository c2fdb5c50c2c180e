"""EAGLE-3 draft heads (Li et al., "EAGLE-3", 2025), in the public checkpoint layouts
(docs/eagle3-design.md §1): one decoder layer that predicts the target's next token from the
target's own hidden states, so a draft costs a single layer and an LM head over a reduced
vocabulary instead of a whole small model.

Row p of a head pairs g_p, a fusion of the target's residual stream entering three of its layers
at position p (`fuse`: fc over their concatenation, [3 Ht] -> [H]), with the embedding of token
p + 1 (the target's own table, shared: the public heads ship none), at rotary position p, and
predicts token p + 2:

    residual, g = g, hidden_norm(g)          (norm_before_residual: g = hidden_norm(g) first)
    x   = [input_layernorm(embed(token)), g]  (2H wide: q/k/v read both halves)
    h   = residual + o_proj(attention(x))     (causal over the head's own cache)
    pre = h + mlp(post_attention_layernorm(h))
    logits over the draft vocabulary = lm_head(norm(pre)); draft id i is target id i + d2t[i]

A chained draft step feeds `pre` back in place of g (it is already H wide). The head's cache
entry for row p depends only on its input (one layer), so positions whose output nobody reads
are written without attending (`write_kv`).

Static buffers make the draft steps graph-friendly: forward reads its incoming states from
`hidden_in[:T]` and leaves `pre` in `hidden_out[:T]` (allocate_hidden), so the runner's
decode-graph path (ridge/runner/cuda_graphs.py) can run and capture it with the runner's own
forward signature. Checkpoint names: `midlayer.*` (the original layout) and `layers.0.*` (the
speculators layout) are both layer 0; `t2d` (the target->draft mask, used only in training) is
not loaded; `embed_tokens.weight` and `fc.bias`, present in some exports, are made when the
checkpoint holds them (`expect_checkpoint`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.layers.attention import AttentionBackend
from ridge.layers.cost import OpCost, StepShape, child, gemm_cost, precision_of
from ridge.layers.embedding import VocabTable
from ridge.layers.linear import Linear
from ridge.layers.mlp import GatedMLP
from ridge.layers.norm import RMSNorm
from ridge.layers.quant.base import QuantConfig
from ridge.layers.rotary import RotaryEmbedding
from ridge.layers.weights import default_weight_loader, set_weight_loader
from ridge.models.draft_head import HiddenStateHead
from ridge.models.llama import CHECKPOINT_NAME_MAP, LlamaAttention, LlamaForCausalLM
from ridge.parallel import SINGLE, TensorParallel


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.eagle.norm_before_residual
        self.hidden_norm, self.input_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn = LlamaAttention(cfg, rotary, backend, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = GatedMLP(H, cfg.intermediate_size, cfg.mlp_bias)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, 2H] what q/k/v read: the normed embedding first, then the normed state; the residual)."""
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual

    def forward(self, positions, embeds, hidden, kv_cache, meta) -> torch.Tensor:
        """The layer's output before the final norm (`pre`: what a chained step reads)."""
        x, residual = self.attention_input(embeds, hidden)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual

    def write_kv(self, positions, embeds, hidden, kv_cache, slot_mapping) -> None:
        self.self_attn.write_kv(positions, self.attention_input(embeds, hidden)[0], kv_cache, slot_mapping)

    def cost(self, step: StepShape) -> list[OpCost]:
        return (child("hidden_norm", self.hidden_norm.cost(step)) + child("input_layernorm", self.input_layernorm.cost(step))
                + child("self_attn", self.self_attn.cost(step))
                + child("post_attention_layernorm", self.post_attention_layernorm.cost(step, residual=True))
                + child("mlp", self.mlp.cost(step)))


@contextmanager
def _made_like(t: torch.Tensor):
    """New parameters on t's device and in its dtype (as load_model builds the model)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(t.dtype)
    try:
        with torch.device(t.device):
            yield
    finally:
        torch.set_default_dtype(default)


class Eagle3ForCausalLM(HiddenStateHead):
    """`d2t` [draft vocab] int64: the draft->target offsets (None: the draft vocabulary is the
    target's). The embedding is the target's table (`share_embedding`) unless the checkpoint has
    one of its own. The interface the head proposer drives: ridge/models/draft_head.py."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int, tp: TensorParallel = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"tensor_parallel_size: an EAGLE-3 head runs on one rank, got {tp.size}")
        e, H = cfg.eagle, cfg.hidden_size
        self.cfg, self.draft_vocab_size = cfg, e.draft_vocab_size
        self.fc = Linear(e.num_aux * e.target_hidden_size, H)
        # rotary tables for the target's context (max_position), whatever the head's own config says
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg, rotary, backend)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = VocabTable(e.draft_vocab_size, H)
        self.d2t = set_weight_loader(nn.Parameter(torch.empty(e.draft_vocab_size, dtype=torch.int64),
                                                  requires_grad=False), self.load_d2t)

    # ---- loading -----------------------------------------------------------------------------

    @staticmethod
    def _own_name(name: str) -> str:
        name = name.removeprefix("model.")
        return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name

    def checkpoint_slot(self, name: str) -> tuple[str | None, str | None]:
        """A checkpoint tensor's (parameter name, shard id), or (None, None) for t2d."""
        name = self._own_name(name)
        if name == "t2d":
            return None, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in CHECKPOINT_NAME_MAP:
                merged, shard = CHECKPOINT_NAME_MAP[part]
                return ".".join(parts[:i] + [merged] + parts[i + 1:]), shard
        return name, None

    checkpoint_name = staticmethod(LlamaForCausalLM.checkpoint_name)

    def expect_checkpoint(self, names: set[str]) -> None:
        """The loader's names before it streams them: an embedding or fc bias of the head's own is
        made when the checkpoint holds one; without d2t the draft vocabulary must be the target's."""
        names = {self._own_name(n) for n in names}
        with _made_like(self.fc.weight):
            if "embed_tokens.weight" in names:
                self.embed_tokens = VocabTable(self.cfg.vocab_size, self.cfg.hidden_size)
            if "fc.bias" in names:
                self.fc = Linear(self.fc.in_features, self.fc.out_features, bias=True)
        if "d2t" not in names and self.draft_vocab_size == self.cfg.vocab_size:
            self.d2t = None

    def load_d2t(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype.is_floating_point or loaded.dtype == torch.bool:
            raise ValueError(f"holds {loaded.dtype}; d2t maps draft ids to target ids as integer offsets")
        if loaded.shape != param.shape:
            raise ValueError(f"has {tuple(loaded.shape)} entries, config.json's draft_vocab_size is {param.shape[0]}")
        default_weight_loader(param, loaded, shard_id)
        ids = torch.arange(param.shape[0], device=param.device) + param.data
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"(d2t) must map the {param.shape[0]} draft ids to distinct target ids in "
                             f"[0, {self.cfg.vocab_size}) as id + d2t[id]")

    def initialize_dummy(self, generator: torch.Generator, std: float) -> None:
        """Dummy weights: the first draft_vocab_size target ids (d2t zero)."""
        self.d2t.zero_()

    # ---- running -----------------------------------------------------------------------------

    def capture_ids(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layers whose input stream the head reads."""
        return self.cfg.eagle.layer_ids(target.num_layers)

    def fuse(self, captured: torch.Tensor) -> torch.Tensor:
        """The target's captured states [T, n Ht] -> the head's input states g [T, H]."""
        return self.fc(captured)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Normed outputs [T, H] (compute_logits' input) of rows whose states are hidden_in[:T];
        `pre` left in hidden_out[:T]."""
        T = input_ids.shape[0]
        pre = self.layers[0](positions, self.embed(input_ids), self.hidden_in[:T], kv_caches[0], meta)
        self.hidden_out[:T].copy_(pre)
        return self.norm(pre)

    def write_kv(self, input_ids, positions, hidden, kv_caches, slot_mapping) -> None:
        """The cache entries of rows (token ids, positions, states [T, H]), without attending."""
        self.layers[0].write_kv(positions, self.embed(input_ids), hidden, kv_caches[0], slot_mapping)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, H] -> [rows, target vocab] float32: the draft vocabulary's logits at their target
        ids, -inf elsewhere (a draft distribution over the target's vocabulary, as verification
        compares it with the target's)."""
        logits = self.lm_head.logits(hidden)
        if self.d2t is None:
            return logits
        ids = torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t
        return logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf")).index_copy_(1, ids, logits)

    def cost(self, step: StepShape) -> list[OpCost]:
        """fc over the rows, the layer, the final norm and the LM head over the rows that sample."""
        w = self.lm_head.weight
        return (child("fc", self.fc.cost(step, name="fc")) + child("layers.0", self.layers[0].cost(step))
                + child("norm", self.norm.cost(step), "final_norm")
                + [gemm_cost("lm_head", step.sampled_rows, w, None, precision_of(w.dtype), step, out_bytes=4)])
