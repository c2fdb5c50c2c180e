"""SiLU-and-mul for gated MLPs: input [.., 2*I] = [gate | up] from the merged gate/up GEMM.

A module, so that the projection it feeds owns it (`Linear(..., input_act=SiluAndMul())`): at one
row on CUDA the down projection's GEMV computes it inside its K loop (no activation kernel, no
[1, I] round trip); otherwise it runs here first (ridge/kernels/silu_mul.py, or the torch reference).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_ref
from ridge.layers.cost import OpCost, StepShape


class SiluAndMul(nn.Module):
    gemv_act = "silu_mul"   # the GEMV's name for this input activation (ridge/kernels/gemv.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)

    def cost(self, step: StepShape, width: int) -> list[OpCost]:
        """silu(gate) * up over `width` outputs a token: sigmoid (exp, add, divide), two multiplies
        = 5 FLOPs an output; reads [T, 2 * width], writes [T, width]."""
        n = step.num_tokens * width
        return [OpCost("activation", "elementwise", 5 * n, 3 * n * step.act.bytes, compute=step.act.compute)]
