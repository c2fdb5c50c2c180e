"""INT4 tables -> the 16-bit weight W [K, N] = (q - z) * s, for cuBLAS at prefill sizes, Triton.

Why a layer would write its weight out: at prefill sizes a GEMM is compute-bound, and the INT4
GEMM (ridge/kernels/int4_gemm.py) dequantizes each weight tile in the warps that then feed the
tensor cores, which keeps them at about half their bf16 roof (the 70B case study's TTFT, 41-52%);
cuBLAS on a 16-bit weight runs near it. Writing W costs 2 bytes a weight and the GEMM reads them
back: ~4.5 bytes a weight moved against the INT4 GEMM's 0.5, a fixed cost a batch of a few
hundred rows repays (ExLlama's "reconstruct" path makes the same trade). Where it pays is measured
per GPU and shape, not assumed (ridge/layers/quant/int4/dispatch.py).

The pass is a stream: a program reads a [BLOCK_K / 8, BLOCK_N] word tile (N contiguous, as ridge's
layout stores it), expands the eight nibbles of each word into the eight K rows they pack, and
writes a [BLOCK_K, BLOCK_N] tile of W with N contiguous. A word row lies in one group (group
sizes are multiples of 8), so scales and zeros are one [BLOCK_K / 8, BLOCK_N] load each. (q - z) * s
is exact in fp32 (|q - z| <= 16 times a 16-bit scale) and rounded once to the activation dtype:
the value int4_matmul's reference rounds to, bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.int4_matmul import PACK, dequantize_int4
from ridge.kernels.rounding import round_to

BLOCK_K, BLOCK_N = 64, 128


@triton.jit
def _dequant_kernel(QW, S, Z, W, K, N, G: tl.constexpr, BK8: tl.constexpr, BN: tl.constexpr,
                    EMULATE_RNE: tl.constexpr):
    rows = tl.program_id(0) * BK8 + tl.arange(0, BK8)          # word rows: K indices 8 r .. 8 r + 7
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (rows < K // 8)[:, None] & (cols < N)[None, :]
    w = tl.load(QW + rows[:, None].to(tl.int64) * N + cols[None, :], mask=ok, other=0)
    group = (rows * 8 // G)[:, None].to(tl.int64) * N + cols[None, :]
    s = tl.load(S + group, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(Z + group, mask=ok, other=0.0).to(tl.float32)
    j = tl.arange(0, 8)
    q = (w[:, None, :] >> (4 * j)[None, :, None]) & 0xF          # [BK8, 8, BN]: row 8 r + j
    val = (q.to(tl.float32) - z[:, None, :]) * s[:, None, :]
    val = tl.reshape(round_to(val, W.dtype.element_ty, EMULATE_RNE), (BK8 * 8, BN))
    k = tl.program_id(0) * BK8 * 8 + tl.arange(0, BK8 * 8)
    tl.store(W + k[:, None].to(tl.int64) * N + cols[None, :], val, mask=(k < K)[:, None] & (cols < N)[None, :])


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """W [K, N] in scales' dtype from ridge's INT4 tables (ridge/kernels/int4_matmul.py): the Triton
    pass on CUDA (and on CPU tensors under TRITON_INTERPRET=1), the torch reference otherwise."""
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    dtype = scales.dtype
    if out is None:
        out = torch.empty((K, N), dtype=dtype, device=qweight.device)
    elif out.shape != (K, N) or out.dtype != dtype or not out.is_contiguous() or out.device != qweight.device:
        raise ValueError(f"int4_dequantize: out must be a contiguous [{K}, {N}] {dtype} on {qweight.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if group_size % PACK:
        raise ValueError(f"int4_dequantize: group_size {group_size} must be a multiple of {PACK}")
    interpret = triton.knobs.runtime.interpret and not qweight.is_cuda
    if not (qweight.is_cuda or interpret) or dtype not in (torch.bfloat16, torch.float16):
        return out.copy_(dequantize_int4(qweight, scales, zeros, group_size))
    grid = (triton.cdiv(K, BLOCK_K), triton.cdiv(N, BLOCK_N))
    _dequant_kernel[grid](qweight.contiguous(), scales.contiguous(), zeros.contiguous(), out, K, N, G=group_size,
                          BK8=BLOCK_K // PACK, BN=BLOCK_N, EMULATE_RNE=interpret, num_warps=4)
    return out
