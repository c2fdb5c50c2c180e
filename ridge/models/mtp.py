"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head (DeepSeek-V3 technical report,
§2.2; vLLM's DeepSeekMTP): the layer the model was trained with to predict one token further,
stored in the target's own checkpoint after its last decoder layer, `model.layers.{L}.*` (L:
num_hidden_layers; ModelConfig.mtp_head). Row p pairs the target's final hidden state at position
p (after its final norm, as vLLM and SGLang hand it over) with the embedding of token p + 1 and
predicts token p + 2:

    h      = eh_proj([enorm(embed(token p + 1)), hnorm(state p)])     (2H -> H, no bias)
    pre    = decoder layer L (MLA attention over the head's own latent cache, MoE or dense MLP
             as layer L's index says), its residual added
    logits = shared_head.head(shared_head.norm(pre))                    (the full vocabulary)

A chained draft step feeds `pre` back as the state (vLLM does the same with k > 1 drafts and one
layer). The layer's `embed_tokens` is a copy of the target's table (the report: shared), so the
target's is used and the copy is not loaded; further MTP layers (L + 1, ...) are not run. The
interface the head proposer drives is ridge/models/draft_head.py's.
"""
from __future__ import annotations

import torch

from ridge.config import ModelConfig
from ridge.layers.attention import AttentionBackend
from ridge.layers.cost import OpCost, StepShape, child, gemm_cost, precision_of
from ridge.layers.embedding import VocabTable
from ridge.layers.linear import Linear
from ridge.layers.norm import RMSNorm
from ridge.layers.quant.base import QuantConfig
from ridge.layers.rotary import RotaryEmbedding
from ridge.models.draft_head import HiddenStateHead
from ridge.models.llama import NORMED, LlamaDecoderLayer, LlamaForCausalLM, layer_index
from ridge.parallel import SINGLE, TensorParallel

OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")      # the MTP layer's tensors outside its decoder layer


class SharedHead(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabTable(cfg.vocab_size, cfg.hidden_size)


class DeepSeekMTP(HiddenStateHead):
    """One MTP layer (cfg: ModelConfig.mtp_head's, cfg.mtp_layer its checkpoint layer)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int, tp: TensorParallel = SINGLE,
                 quant: QuantConfig | None = None):
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"tensor_parallel_size: an MTP head runs on one rank, got {tp.size}")
        H = cfg.hidden_size
        self.cfg = cfg
        self.eh_proj = Linear(2 * H, H)
        self.enorm, self.hnorm = RMSNorm(H, cfg.rms_norm_eps), RMSNorm(H, cfg.rms_norm_eps)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(cfg, rotary, backend, cfg.mtp_layer, tp, quant)])
        self.shared_head = SharedHead(cfg)

    # ---- loading -----------------------------------------------------------------------------

    def checkpoint_slot(self, name: str) -> tuple[str | None, str | None]:
        """A checkpoint tensor's (parameter name, shard id); (None, None) for every tensor outside
        layer cfg.mtp_layer and for its copy of the embedding."""
        if layer_index(name) != self.cfg.mtp_layer:
            return None, None
        rest = name.split(".", 3)[3]
        if rest.startswith(OWN):
            return rest, None
        if rest.startswith("embed_tokens."):
            return None, None
        return LlamaForCausalLM.checkpoint_slot(self, "layers.0." + rest)

    def checkpoint_name(self, param: str, shard: str | None) -> str:
        """The checkpoint name of a parameter's shard (for messages about missing tensors)."""
        name = LlamaForCausalLM.checkpoint_name(param, shard)
        return f"model.layers.{self.cfg.mtp_layer}.{name.removeprefix('layers.0.')}"

    # ---- running -----------------------------------------------------------------------------

    def capture_ids(self, target: ModelConfig) -> tuple[int, ...]:
        """The target's final normed state (LlamaModel.capture_layers' NORMED)."""
        return (NORMED,)

    def fuse(self, captured: torch.Tensor) -> torch.Tensor:
        """The captured states are the head's input as they are (hnorm is applied in the layer,
        to chained states alike)."""
        return captured

    def _input(self, input_ids, hidden) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(self.embed(input_ids)), self.hnorm(hidden)], dim=-1))

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Normed outputs [T, H] (compute_logits' input) of rows whose states are hidden_in[:T];
        `pre` left in hidden_out[:T]."""
        T = input_ids.shape[0]
        x, residual = self.layers[0](positions, self._input(input_ids, self.hidden_in[:T]), None, kv_caches[0], meta)
        pre = self.hidden_out[:T]
        torch.add(x, residual, out=pre)
        return self.shared_head.norm(pre)

    def write_kv(self, input_ids, positions, hidden, kv_caches, slot_mapping) -> None:
        """The cache entries of rows (token ids, positions, states [T, H]), without attending."""
        layer = self.layers[0]
        layer.self_attn.write_kv(positions, layer.input_layernorm(self._input(input_ids, hidden)), kv_caches[0],
                                 slot_mapping)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, H] -> [rows, vocab] float32."""
        return self.shared_head.head.logits(hidden)

    def cost(self, step: StepShape) -> list[OpCost]:
        """The input norms and eh_proj, the decoder layer, the head's norm and LM head over the
        rows that sample."""
        T, w = step.num_tokens, self.shared_head.head.weight
        return (child("enorm", self.enorm.cost(step, T)) + child("hnorm", self.hnorm.cost(step, T))
                + child("eh_proj", self.eh_proj.cost(step, name="eh_proj"))
                + child("layers.0", self.layers[0].cost(step, first=True))
                + child("shared_head.norm", self.shared_head.norm.cost(step), "final_norm")
                + [gemm_cost("lm_head", step.sampled_rows, w, None, precision_of(w.dtype), step, out_bytes=4)])
