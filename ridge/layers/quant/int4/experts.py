"""INT4 experts quantized at load: each expert's matrices round to nearest, asymmetric, a scale and
zero point per group of 128 inputs (the dense layers' grid, ridge/layers/quant/int4/formats.py), and
the expert kernels dequantize tiles in registers (ridge/kernels/moe_quant.py): decode, where a
mixture-of-experts model spends its time at serving batch sizes, streams the experts' bytes."""
from __future__ import annotations

import torch

from ridge.kernels.int4_matmul import PACK
from ridge.kernels.moe_quant import INT4_GROUP, Int4Experts
from ridge.layers.quant.base import ExpertsQuantizedAtLoad
from ridge.layers.quant.int4.formats import pack_last, quantize_rtn


def quantize_experts_int4(w: torch.Tensor) -> Int4Experts:
    """Float experts [E, N, K] (K a multiple of 8) -> INT4 codes packed along K, scales and zero points
    per group of 128 inputs in w's dtype: min-max round to nearest (ridge/layers/quant/int4/formats.py,
    the dense layers' grid, whose short last group is quantized padded with zeros), expert by expert."""
    E, N, K = w.shape
    if K % PACK:
        raise ValueError(f"INT4 experts: {K} inputs (w [E={E}, N={N}, K={K}]) are not a multiple of {PACK}, the "
                         f"codes an int32 word packs")
    q, scale, zero = [], [], []
    for e in range(E):
        qe, se, ze = quantize_rtn(w[e], INT4_GROUP, scale_dtype=w.dtype)
        q.append(pack_last(qe))
        scale.append(se)
        zero.append(ze.to(w.dtype))
    return Int4Experts(torch.stack(q), torch.stack(scale), torch.stack(zero), K)


class Int4AtLoadExperts(ExpertsQuantizedAtLoad):
    """Float experts quantized to INT4 (round to nearest, group 128) once loaded."""
    quantize = staticmethod(quantize_experts_int4)

    def weight_bytes(self, model_dtype: torch.dtype) -> float:
        """0.5 a weight plus its group's scale and zero point (the model's dtype) shared by 128."""
        return 0.5 + 2 * torch.empty(0, dtype=model_dtype).element_size() / INT4_GROUP
