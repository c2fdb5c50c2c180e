"""RMSNorm, with the residual add folded in.

`forward(x, residual)` returns `(norm(x + residual), x + residual)`: the decoder's two
"add residual, then normalise" points become one call, which on CUDA the fused Triton kernel
(ridge/kernels/rmsnorm.py) serves with one read of x and residual and one write of each output;
on the CPU its torch reference serves it. The arithmetic follows transformers (normalise in
float32, scale in the input dtype) so float32 logits match it to rounding; the kernel rounds at
the same points.
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.rmsnorm import rms_norm, rms_norm_ref
from ridge.layers.weights import set_weight_loader


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
