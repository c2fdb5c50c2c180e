"""Linear layers, including merged projections.

QKV and gate/up are each stored as one weight, so one GEMM reads the activations once and the
weight matrix streams through in one pass. `shards` records where each checkpoint tensor lands
inside the merged weight; the loader uses it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: dict[str, int] | int, bias: bool = False):
        super().__init__()
        if isinstance(out_sizes, int):
            out_sizes = {"": out_sizes}
        self.shards: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in out_sizes.items():
            self.shards[name] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
