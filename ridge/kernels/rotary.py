"""Rotary position embedding on q and k in one launch (Triton). Reference: ridge.layers.rotary.

Rotate-half (NeoX) layout, as in HF Llama checkpoints: with x = [x1 | x2] (halves of head_dim),

    out = [x1 * cos - x2 * sin  |  x2 * cos + x1 * sin]

where cos/sin are rows of RotaryEmbedding's fp32 tables [max_position, head_dim], gathered by
each token's position. Those tables are cat(freqs, freqs), so both halves of a row are equal and
the kernel reads only the first half: head_dim/2 cos + head_dim/2 sin floats per token.

One program per token rotates all of that token's q heads and then all of its k heads: the
cos/sin row is gathered once per token and reused from registers for every head of q and k
(separate launches for q and k would gather it twice, and torch's version materialises the
gathered [T, head_dim] tables, a rotate_half copy and three temporaries per tensor). The heads
are walked in [BLOCK_H, head_dim/2] tiles, each x1 and x2 half a wide load from one row.

Rounding: everything is computed in fp32 from the fp32 tables and rounded once to q's dtype.
The reference instead rounds cos/sin to the input dtype and rounds after each bf16 op (two
products, one sum), so in bf16 the kernel is *more* accurate than the reference and they differ
by a few bf16 ulps of |x|; in fp32 they agree to fp32 rounding.

q, k may be strided views (q and k split out of the QKV GEMM output): all strides are passed,
nothing is copied. Out-of-place by default; pass q_out=q, k_out=k to rotate in place (each
program loads both halves of a head before storing them). Positions must be < max_position
(the runner guarantees it; the kernel cannot check without a host sync). CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.rounding import emulate_rne, round_to


@triton.jit
def _rotate_heads(X, Out, tok, cos, sin, stride_xt, stride_xh, stride_xd, stride_ot, stride_oh, stride_od,
                  H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  EMULATE_RNE: tl.constexpr):
    d = tl.arange(0, BLOCK_HALF)[None, :]
    x_row = X + tok * stride_xt
    o_row = Out + tok * stride_ot
    # unrolled (H is a constexpr): the next tile's loads can issue before this tile's stores
    for h0 in tl.static_range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < H) & (d < HALF)
        x1 = tl.load(x_row + h * stride_xh + d * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + h * stride_xh + (d + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(o_row + h * stride_oh + d * stride_od, round_to(o1, Out.dtype.element_ty, EMULATE_RNE),
                 mask=mask)
        tl.store(o_row + h * stride_oh + (d + HALF) * stride_od,
                 round_to(o2, Out.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, QOut, KOut, Pos, Cos, Sin,
                   stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                   stride_qot, stride_qoh, stride_qod, stride_kot, stride_koh, stride_kod,
                   stride_cp, stride_cd, stride_sp, stride_sd,
                   HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   EMULATE_RNE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(Cos + pos * stride_cp + d * stride_cd, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sp + d * stride_sd, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(Q, QOut, tok, cos, sin, stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, stride_qod,
                  HQ, HALF, BLOCK_HQ, BLOCK_HALF, EMULATE_RNE)
    _rotate_heads(K, KOut, tok, cos, sin, stride_kt, stride_kh, stride_kd, stride_kot, stride_koh, stride_kod,
                  HK, HALF, BLOCK_HK, BLOCK_HALF, EMULATE_RNE)


def launch_config(q_heads: int, k_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_HALF, BLOCK_HQ, BLOCK_HK, num_warps): tiles of ~2K elements per half
    (32 heads x 64 for Llama-8B q), 4 warps -> 16 elements per thread per half in flight."""
    block_half = triton.next_power_of_2(head_dim // 2)
    cap = max(1, 2048 // block_half)
    block_hq = min(triton.next_power_of_2(q_heads), cap)
    block_hk = min(triton.next_power_of_2(k_heads), cap)
    num_warps = max(1, min(8, block_hq * block_half // 512))
    return block_half, block_hq, block_hk, num_warps


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """q: [T, H, d], k: [T, kvh, d] (any strides); positions: [T] int; cos, sin: [max_pos, d]
    with equal halves (cat(freqs, freqs)). Returns (q_out, k_out), contiguous unless given."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_rotary: q [T, H, d] and k [T, kvh, d] expected, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, q_heads, head_dim = q.shape
    if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"apply_rotary: head_dim {head_dim} must be even and match the tables' {cos.shape[-1]}")
    if positions.shape != (tokens,):
        raise ValueError(f"apply_rotary: positions must be [T={tokens}], got {tuple(positions.shape)}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError("apply_rotary: q_out/k_out must have q's/k's shape")
    if tokens > 0:
        block_half, block_hq, block_hk, num_warps = launch_config(q_heads, k.shape[1], head_dim)
        _rotary_kernel[(tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos.stride(), *sin.stride(),
            HQ=q_heads, HK=k.shape[1], HALF=head_dim // 2,
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
            EMULATE_RNE=emulate_rne(q), num_warps=num_warps)
    return q_out, k_out
