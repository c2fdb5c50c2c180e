"""The gated MLP of the Llama family, down(silu(gate(x)) * up(x)): the dense decoder MLP, and
Qwen2-MoE's shared expert. gate and up are one merged projection (one GEMM reads x once); the
activation belongs to the down projection, whose one-row GEMV computes it inside its K loop
(ridge/layers/linear.py)."""
from __future__ import annotations

from torch import nn

from ridge.layers.activation import SiluAndMul
from ridge.layers.cost import OpCost, StepShape, child
from ridge.layers.linear import Linear
from ridge.parallel import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    """Under tensor parallelism each rank holds an equal share of the intermediate columns: gate
    and up column-parallel, down row-parallel (one all-reduce of its partial sums)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, quant=None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, {"gate": intermediate_size, "up": intermediate_size},
                                   bias=bias, quant=quant, tp=tp, parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, input_act=SiluAndMul(), quant=quant,
                                tp=tp, parallel="row")

    @property
    def input_proj(self) -> Linear:
        """The one projection reading the block's input (the norm before it may hand it FP8)."""
        return self.gate_up_proj

    def forward(self, x):
        return self.down_proj(self.gate_up_proj(x))

    def cost(self, step: StepShape) -> list[OpCost]:
        return (child("gate_up_proj", self.gate_up_proj.cost(step, name="gate_up_proj"))
                + child("down_proj", self.down_proj.cost(step, name="down_proj")))
