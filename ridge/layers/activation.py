"""SiLU-and-mul for gated MLPs: input [.., 2*I] = [gate | up] from the merged gate/up GEMM.

`silu_and_mul` is what the model calls: the fused Triton kernel (ridge/kernels/silu_mul.py) on
CUDA, the torch reference on the CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from ridge.kernels.silu_mul import silu_and_mul as silu_and_mul_triton
except ImportError:  # no triton: the reference serves every device
    silu_and_mul_triton = None


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and silu_and_mul_triton is not None:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
