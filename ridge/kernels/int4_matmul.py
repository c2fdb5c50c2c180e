"""INT4 weight-only matmul (W4A16): y = x @ dequantize(W) with group-wise scales and zero points.

ridge's one in-memory layout for 4-bit weights, whatever format the checkpoint used (AWQ, GPTQ,
compressed-tensors; the layer's weight_loader converts): for a layer with K inputs and N outputs,
  qweight  int32 [K // 8, N]: nibble j (bits 4j..4j+3) of qweight[i, n] is q[8 i + j, n], q in [0, 15];
  scales   [K // group_size, N], the activation dtype;
  zeros    [K // group_size, N], the activation dtype: the zero point z (an integer value);
  W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].
Packing along K keeps eight consecutive K elements of one output column in one 32-bit word: a
tile of the weight is a plain 2-D load with N contiguous (coalesced), and the eight nibbles of a
word are the eight K values one column's dot product needs next, so they are unpacked in
registers right before the multiply; the scale and zero of a group are one row of each table.
"""
from __future__ import annotations

import torch

PACK = 8            # int4 values per int32 word


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [K, N] int32 values in [0, 15]."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts.view(1, PACK, 1)) & 0xF
    return q.reshape(qweight.shape[0] * PACK, qweight.shape[1])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[K, N] integers in [0, 15] (K a multiple of 8) -> [K // 8, N] int32, the inverse of unpack_int4."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"has {k} rows to pack, not a multiple of {PACK}")
    q = q.to(torch.int64).reshape(k // PACK, PACK, n)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64).view(1, PACK, 1)
    packed = (q << shifts).sum(dim=1)                              # < 2^32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [K, N] weight the packed tables stand for (the reference every path matches)."""
    q = unpack_int4(qweight).float()
    group = torch.arange(q.shape[0], device=q.device) // group_size
    return (q - zeros.float()[group]) * scales.float()[group]


def int4_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """x [M, K] @ W [K, N] in float32, returned in x's dtype."""
    return (x.float() @ dequantize_int4(qweight, scales, zeros, group_size)).to(x.dtype)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [M, K] @ W [K, N]."""
    return int4_matmul_ref(x, qweight, scales, zeros, group_size)
