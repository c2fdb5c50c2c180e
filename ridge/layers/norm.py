"""RMSNorm, with the residual add folded in.

`forward(x, residual)` returns `(norm(x + residual), x + residual)`: the decoder's two
"add residual, then normalise" points become one call, which on CUDA the fused Triton kernel
(ridge/kernels/rmsnorm.py) serves with one read of x and residual and one write of each output;
on the CPU the torch reference below serves it. The arithmetic follows transformers (normalise
in float32, scale in the input dtype) so float32 logits match it to rounding; the kernel rounds
at the same points.

Fused into the projection (opt-in, environment RIDGE_FUSE_NORM=1; off until measured on a GPU).
A decoder layer's two norms each feed exactly one projection (qkv, gate/up). At batch 1 a norm
is a tiny kernel - a [1, hidden] row in, two rows out - whose cost in a decode step is launch and
latency (~1 us of work, several of gap), not bytes. A norm built with feeds_projection=True then
returns a PendingNorm instead of computing: the Linear that receives it runs ridge's GEMV with
act="rms_norm", which computes the norm (and writes the residual sum) inside the projection's
own kernel (ridge/kernels/gemv.py). Anything else that receives a PendingNorm calls
materialize(), which runs the ordinary kernel: the result is the same function either way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ridge.layers.cost import OpCost, StepShape

try:
    from ridge.kernels.rmsnorm import rms_norm as rms_norm_triton
except ImportError:  # no triton: the reference serves every device
    rms_norm_triton = None


# Read at every call (and so fixed into a CUDA graph when it is captured).
FUSE_INTO_PROJECTION = os.environ.get("RIDGE_FUSE_NORM", "0") == "1"


def defers_to_projection(x: torch.Tensor) -> bool:
    """Whether a norm that feeds a projection hands x to it as a PendingNorm: the switch is on, and
    x is one CUDA row (the GEMV's FMA path, where the fusion is cheap; ridge/kernels/gemv.py)."""
    return FUSE_INTO_PROJECTION and rms_norm_triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1


@dataclass
class PendingNorm:
    """RMSNorm(x + residual) with `weight`, not computed yet; `residual_out` (allocated, not yet
    written) receives x + residual when it is (see the module docstring)."""
    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        if self.residual is None:
            return rms_norm_triton(self.x, self.weight, self.eps)
        out, _ = rms_norm_triton(self.x, self.weight, self.eps, self.residual, residual_out=self.residual_out)
        return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, feeds_projection: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.feeds_projection = feeds_projection   # its only reader is a Linear (see the module docstring)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.feeds_projection and defers_to_projection(x):
            if residual is None:
                return PendingNorm(x, self.weight, self.eps)
            residual_out = torch.empty_like(x)
            return PendingNorm(x, self.weight, self.eps, residual, residual_out), residual_out
        if x.is_cuda and rms_norm_triton is not None:
            return rms_norm_triton(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def cost(self, step: StepShape, rows: int | None = None, residual: bool = False,
             residual_out: bool = True) -> list[OpCost]:
        """x*x, accumulate, scale by 1/rms, by the weight: 4 FLOPs an element, +1 for the residual
        add; reads x (and the residual), writes the output (and the sum, unless never read)."""
        n = (step.num_tokens if rows is None else rows) * self.weight.shape[0]
        moved = 2 + (1 + residual_out if residual else 0)
        params = self.weight.numel() * self.weight.element_size()
        return [OpCost("norm", "elementwise", (4 + residual) * n, moved * n * step.act.bytes + params, params,
                       compute=step.act.compute)]
