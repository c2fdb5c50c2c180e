"""The sparse MLP block of Mixtral, Qwen2-MoE and Qwen3-MoE (one block for all three; the
attention and the rest of the decoder are llama.py's). A router (`gate`, a Linear to one logit
per expert) scores the experts; `experts` (ridge/layers/moe.py) routes each token to its top_k and
sums their outputs. Qwen2-MoE adds a shared expert every token runs, scaled by
sigmoid(shared_expert_gate(x)). Module names are the checkpoints' (Mixtral's `block_sparse_moe`
and `w1`/`w3`/`w2` are mapped by llama.py's checkpoint_slot).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.model_config import ModelConfig
from ridge.layers.cost import OpCost, StepShape, child
from ridge.layers.linear import Linear
from ridge.layers.mlp import GatedMLP
from ridge.layers.moe import FusedMoE


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = Linear(cfg.hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.expert_size, moe.renormalize)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_expert_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(self.gate(x), x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def cost(self, step: StepShape) -> list[OpCost]:
        out = child("gate", self.gate.cost(step, name="moe_router")) + child("experts", self.experts.cost(step))
        if self.shared_expert is not None:
            T, H = step.num_tokens, self.shared_expert_gate.in_features
            mix = OpCost("shared_expert_mix", "elementwise", 4 * T * H, (3 * T * H + T) * step.act.bytes,
                         compute=step.act.compute)
            out += (child("shared_expert", self.shared_expert.cost(step))
                    + child("shared_expert_gate", self.shared_expert_gate.cost(step, name="shared_expert_gate"))
                    + [mix])
        return out
