"""RMSNorm, with the residual add folded in.

`forward(x, residual)` returns `(norm(x + residual), x + residual)`: the decoder's two "add
residual, then normalise" points become one call, which the fused Triton kernel
(ridge/kernels/rmsnorm.py) serves with one read of x and residual and one write of each output.
The arithmetic follows transformers (normalise in float32, scale in the input dtype) so float32
logits match it to rounding; the kernel rounds at the same points.

A norm that `feeds` one projection (the decoder's norms before QKV and gate-up) asks it per batch
whether its GEMM is an FP8 kernel; if so the kernel quantizes the output for it on the way out
(rms_norm_fp8: an Fp8Activation, 1 byte an element plus a scale per 128 channels, in place of the
bf16 row a separate quantization pass would read back). The consumer is a kernel path, so this is
too (a CPU reaches it only under Triton's interpreter, in tests).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.rmsnorm import rms_norm, rms_norm_fp8, rms_norm_ref
from ridge.layers.cost import FP8_ACT, OpCost, StepShape
from ridge.layers.linear import Linear
from ridge.layers.quant.fp8_linear import Fp8Activation
from ridge.layers.weights import set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, feeds: Linear | None = None):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(nn.Parameter(torch.empty(dim), requires_grad=False))
        # held, not registered: the projection belongs to its block (as a child here its weights
        # would be listed twice)
        object.__setattr__(self, "feeds", feeds)
        if feeds is not None:
            feeds.fp8_producer = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.feeds is not None and self.feeds.takes_fp8(x.shape[:-1].numel()):
            out = rms_norm_fp8(x, self.weight, self.eps, residual)
            return Fp8Activation(*out, x.dtype) if residual is None else (Fp8Activation(*out[0], x.dtype), out[1])
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def cost(self, step: StepShape, rows: int | None = None, residual: bool = False,
             residual_out: bool = True) -> list[OpCost]:
        """x*x, accumulate, scale by 1/rms, by the weight: 4 FLOPs an element, +1 for the residual
        add, +4 quantizing for the projection it feeds; reads x (and the residual), writes the
        output (FP8_ACT where it quantizes) and the sum, unless never read."""
        rows = step.num_tokens if rows is None else rows
        n, params = rows * self.weight.shape[0], self.weight.nbytes
        fp8 = self.feeds is not None and self.feeds.fed_fp8(step, rows)
        moved = 1 + (1 + residual_out if residual else 0)
        out = FP8_ACT.bytes if fp8 else step.act.bytes
        return [OpCost("norm", "elementwise", (4 + residual + 4 * fp8) * n, n * (moved * step.act.bytes + out) + params,
                       params, compute=step.act.compute)]
