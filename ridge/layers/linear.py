"""Linear layers, including merged projections.

QKV and gate/up are each stored as one weight, so one GEMM reads the activations once and the
weight matrix streams through in one pass. `shards` records where each checkpoint tensor lands
inside the merged weight; the loader uses it.

Small batches (decode): with at most GEMV_MAX_ROWS (8) rows of x, a projection is a weight
stream - ~2 FLOPs per weight element read - and what matters is the fraction of copy bandwidth
it reaches in as few launches as possible. There cuBLAS picks split-K kernels: two launches
(partials + reduce) for o_proj and down_proj, ~1.5 us each inside a CUDA graph, and on an H200
only 64% (o_proj) and 76% (qkv) of copy bandwidth. So on CUDA, when Triton is importable and
the module switch SMALL_BATCH_GEMV is on, such inputs go to ridge's one-launch GEMV
(ridge/kernels/gemv.py); everything else, and every CPU tensor, goes to F.linear.

`forward(x, act="silu_mul")` takes the merged gate/up output [M, 2K] and applies silu(gate) * up
first: fused into the GEMV's K loop for a single row (no activation kernel, no [M, K] round
trip), silu_and_mul then the GEMV or F.linear otherwise. It is the same function on every path; only the kernels
(and fp32 summation order) differ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.layers.activation import silu_and_mul
from ridge.layers.cost import OpCost, Precision, StepShape, gemm_cost, precision_of
from ridge.layers.norm import PendingNorm

try:
    from ridge.kernels.gemv import GEMV_MAX_ROWS, gemv as gemv_triton
except ImportError:  # no triton: F.linear serves every device
    GEMV_MAX_ROWS, gemv_triton = 0, None

# Send CUDA inputs of <= GEMV_MAX_ROWS rows to ridge's GEMV. Read at every call (and so fixed
# into a CUDA graph when it is captured); False restores F.linear everywhere, e.g. to compare.
SMALL_BATCH_GEMV = True

ACTS = (None, "silu_mul")


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether Linear.forward sends x to ridge's GEMV rather than F.linear."""
    return (SMALL_BATCH_GEMV and gemv_triton is not None and x.is_cuda and x.dim() == 2
            and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype == weight.dtype)


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

    def forward(self, x: torch.Tensor | PendingNorm, act: str | None = None) -> torch.Tensor:
        """act(x) @ weight^T (+ bias). act=None: x is [.., in_features]; act="silu_mul": x is
        [.., 2 * in_features] = [gate | up] and the input is silu(gate) * up. x may be a
        PendingNorm (ridge/layers/norm.py): computed inside the GEMV for one row, else first."""
        if act not in ACTS:
            raise ValueError(f"Linear: act must be one of {ACTS}, got {act!r}")
        if isinstance(x, PendingNorm):
            if act is None and uses_gemv(x.x, self.weight) and x.x.shape[0] == 1 and x.weight.dtype == x.x.dtype:
                return gemv_triton(x.x, self.weight, self.bias, act="rms_norm", norm_weight=x.weight, eps=x.eps,
                                   residual=x.residual, residual_out=x.residual_out)
            x = x.materialize()
        gemv = uses_gemv(x, self.weight)
        if act == "silu_mul" and not (gemv and x.shape[0] == 1):
            # the fused activation pays only on the M = 1 (FMA) path: on an H200 (2026-11-23,
            # benchmarks/gemv.py) down+silu at 8B shape ran 29.4 us fused vs 33.3 us unfused at
            # M = 1, but 61-219 us fused vs 33-34 us unfused at M = 2-8 (tensor-core path)
            x = silu_and_mul(x)
            act = None
        if gemv:
            return gemv_triton(x, self.weight, self.bias, act=act)
        return F.linear(x, self.weight, self.bias)

    def weight_precision(self, step: StepShape) -> Precision:
        """How the weight is stored: as its dtype, or the step's what-if format (a quantised Linear
        states its own)."""
        return step.weights or precision_of(self.weight.dtype)

    def cost(self, step: StepShape, rows: int | None = None, out_bytes: float | None = None) -> list[OpCost]:
        """One GEMM over `rows` (default: every token of the step); `out_bytes` an output element."""
        return [gemm_cost("linear", step.num_tokens if rows is None else rows, self.weight, self.bias,
                          self.weight_precision(step), step, out_bytes)]
