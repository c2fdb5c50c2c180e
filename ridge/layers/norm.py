"""RMSNorm, with the residual add folded in.

`forward(x, residual)` returns `(norm(x + residual), x + residual)`: the decoder's two
"add residual, then normalise" points become one call, which on CUDA the fused Triton kernel
(ridge/kernels/rmsnorm.py) serves with one read of x and residual and one write of each output;
on the CPU the torch reference below serves it. The arithmetic follows transformers (normalise
in float32, scale in the input dtype) so float32 logits match it to rounding; the kernel rounds
at the same points.
"""
from __future__ import annotations

import torch
from torch import nn

try:
    from ridge.kernels.rmsnorm import rms_norm as rms_norm_triton
except ImportError:  # no triton: the reference serves every device
    rms_norm_triton = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and rms_norm_triton is not None:
            return rms_norm_triton(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_ref(residual, self.weight, self.eps), residual
