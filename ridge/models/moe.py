"""The sparse MLP block of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 (one block for all;
the rest of the decoder is llama.py's). A router (`gate`, a Linear to one logit per expert)
scores the experts; `experts` (ridge/layers/moe.py) routes each token to its top_k and sums their
outputs. Qwen2-MoE adds a shared expert every token runs, scaled by
sigmoid(shared_expert_gate(x)); DeepSeek's shared experts (one MLP) are ungated, and its router
(float32 logits, group-limited choice, V3's score bias) is FusedMoE's `grouped` routing. Module
names are the checkpoints' (Mixtral's `block_sparse_moe` and `w1`/`w3`/`w2`, DeepSeek's
`shared_experts` are mapped by llama.py's checkpoint_slot). Quantized (`quant`), the router stays
float; the experts take the method's experts format (a weight-only format, or a checkpoint's
stored blocks), the shared expert is a dense MLP of quantized Linears.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.model_config import ModelConfig
from ridge.layers.cost import OpCost, StepShape, all_reduce_cost, child
from ridge.layers.linear import Linear
from ridge.layers.mlp import GatedMLP
from ridge.layers.moe import FusedMoE
from ridge.layers.quant.base import QuantConfig
from ridge.layers.weights import set_weight_loader
from ridge.parallel import SINGLE, TensorParallel


class SparseMoeBlock(nn.Module):
    """Under tensor parallelism the router is whole on every rank; the experts and the shared
    expert hold their rank's share of the intermediate columns."""

    input_proj = None       # the router, the experts and a shared expert all read the input

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, quant: QuantConfig | None = None):
        super().__init__()
        moe = cfg.moe
        self.gate = Linear(cfg.hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.expert_size, moe.renormalize,
                                moe.grouped, tp=tp, quant=quant)
        if moe.grouped is not None:     # DeepSeek routes in float32: the router weight is kept so (exact)
            self.gate.weight.data = self.gate.weight.data.float()
        if moe.grouped is not None and moe.grouped.score_bias:     # V3: chooses experts, does not weigh them
            self.gate.e_score_correction_bias = set_weight_loader(
                nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_expert_size, cfg.mlp_bias, quant, tp)
        if moe.shared_expert_size and moe.shared_expert_gated:
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.grouped is None:
            return self.gate(x)
        return F.linear(x.float(), self.gate.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(self.router_logits(x), x, getattr(self.gate, "e_score_correction_bias", None))
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def cost(self, step: StepShape) -> list[OpCost]:
        out = child("gate", self.gate.cost(step, name="moe_router")) + child("experts", self.experts.cost(step))
        # the experts' partial sums over their intermediate shares: one all-reduce in FusedMoE.forward
        out += child("experts", all_reduce_cost("moe_experts.all_reduce", step.num_tokens, self.gate.in_features, step,
                                                self.experts.tp.size))
        if self.shared_expert is not None:
            T, H, gated = step.num_tokens, self.gate.in_features, self.shared_expert_gate is not None
            mix = OpCost("shared_expert_mix", "elementwise", (4 if gated else 1) * T * H,
                         (3 * T * H + (T if gated else 0)) * step.act.bytes, compute=step.act.compute)
            out += child("shared_expert", self.shared_expert.cost(step)) + [mix]
            if gated:
                out += child("shared_expert_gate", self.shared_expert_gate.cost(step, name="shared_expert_gate"))
        return out
