"""SiLU-and-mul for gated MLPs: input [.., 2*I] = [gate | up] from the merged gate/up GEMM."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
