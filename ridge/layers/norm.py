"""RMSNorm, with the residual add folded in.

`forward(x, residual)` returns `(norm(x + residual), x + residual)`: the decoder's two "add
residual, then normalise" points become one call, which the fused Triton kernel
(ridge/kernels/rmsnorm.py) serves with one read of x and residual and one write of each output.
The arithmetic follows transformers (normalise in float32, scale in the input dtype) so float32
logits match it to rounding; the kernel rounds at the same points.
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.rmsnorm import rms_norm, rms_norm_ref
from ridge.layers.weights import set_weight_loader
from ridge.layers.cost import OpCost, StepShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(nn.Parameter(torch.empty(dim), requires_grad=False))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def cost(self, step: StepShape, rows: int | None = None, residual: bool = False,
             residual_out: bool = True) -> list[OpCost]:
        """x*x, accumulate, scale by 1/rms, by the weight: 4 FLOPs an element, +1 for the residual
        add; reads x (and the residual), writes the output (and the sum, unless never read)."""
        n, params = (step.num_tokens if rows is None else rows) * self.weight.shape[0], self.weight.nbytes
        moved = 2 + (1 + residual_out if residual else 0)
        return [OpCost("norm", "elementwise", (4 + residual) * n, moved * n * step.act.bytes + params, params,
                       compute=step.act.compute)]
