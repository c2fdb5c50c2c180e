"""Quantized experts for the MoE kernels (ridge/kernels/moe_gemm.py): the weight formats and the one
'load a dequantized weight tile' entry every expert kernel reads its weights through.

Weight-only formats, both [E, N, K] with rows contiguous along K like the float experts:

  * `Fp8Experts`: e4m3 values q [E, N, K] and fp32 scales [E, ceil(N / 128), ceil(K / 128)], one per
    128 x 128 block of each expert (the HF fp8 checkpoints' weight_scale_inv). 1 byte a weight.
  * `Int4Experts`: 4-bit codes packed eight to an int32 word along K, q [E, N, ceil(K / 8)] (nibble j
    of word [e, n, i] is q[e, n, 8 i + j], as compressed-tensors' weight_packed), and per group of
    128 inputs of a row a scale and a zero point in the activation dtype, [E, N, ceil(K / 128)]:
    W = (q - z) * s, the dense INT4 layers' arithmetic (ridge/kernels/int4_matmul.py) with the
    expert kernels' row-major orientation. 0.5 byte a weight plus 4 / 128 for the group's pair
    in bf16. The last group of a K that 128 does not divide is short (zero padding, which min-max
    round to nearest leaves unchanged since its range always holds 0), so any K that 8 divides works.

Decode streams the selected experts' bytes, so the kernels read these formats as stored and
dequantize each tile in registers to the activation dtype (rounded as the reference's dequantized
weight is) right before the FMA or tensor-core dot. A tile's K range must lie within one scale
block or group, so K tiles must divide 128 (`tiles_fit`). The INT4 tile here gathers each word once
per nibble and shifts its nibble out: a plain 2-D load with no re-layout, ~22 instructions a weight.
It serves only the grouped tiles narrower than a group; the small path and 128-wide grouped tiles
read INT4 as nibble planes (ridge/kernels/moe_int4.py), 3-4x fewer instructions a weight.

The format reaches the kernels as a constexpr (`FMT`): one kernel source, three compiled variants.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ridge.kernels.int4_matmul import dequantize_int4
from ridge.kernels.pdl import pdl_wait
from ridge.kernels.rounding import round_to

FP8_BLOCK = 128
INT4_GROUP = 128
FLOAT, FP8, INT4 = 0, 1, 2          # the kernels' FMT constexpr


class Fp8Experts(NamedTuple):
    """Experts' weights kept in FP8 (module docstring)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    shape = property(lambda self: self.q.shape)
    device = property(lambda self: self.q.device)


class Int4Experts(NamedTuple):
    """Experts' weights in INT4 (module docstring); k: the true K (q holds ceil(k / 8) words a row)."""
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    k: int

    shape = property(lambda self: torch.Size((*self.q.shape[:2], self.k)))
    device = property(lambda self: self.q.device)
    dtype = property(lambda self: self.scale.dtype)


def expert_tables(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(values, scales, zero points, FMT) as the kernels take them. The kernels' FLOAT variant reads
    no scale or zero-point pointer, so a float weight passes itself in those slots; FP8 has no zero
    points (its scales fill that slot, unread)."""
    if isinstance(w, Int4Experts):
        return w.q, w.scale, w.zero, INT4
    if isinstance(w, Fp8Experts):
        return w.q, w.scale, w.scale, FP8
    return w, w, w, FLOAT


def format_name(w) -> str:
    """'' for float experts, else the format's suffix ('-fp8', '-int4'): the MoE plan's cache key."""
    return {FLOAT: "", FP8: "-fp8", INT4: "-int4"}[expert_tables(w)[3]]


def tiles_fit(w, *block_ks: int) -> bool:
    """Whether these K tile widths serve experts in w's format: each must lie within one 128-wide
    scale block (FP8) or group (INT4); float experts take any."""
    return expert_tables(w)[3] == FLOAT or all(128 % k == 0 for k in block_ks)


def check_tiles(w, *block_ks: int) -> None:
    if not tiles_fit(w, *block_ks):
        raise ValueError(f"fused_moe: {type(w).__name__} need tiles whose K width divides 128, got {block_ks}")


def dequantize_experts(w) -> torch.Tensor:
    """The float weights [E, N, K] quantized experts stand for (in their dtype); float ones as they are."""
    if isinstance(w, Fp8Experts):
        E, N, K = w.q.shape
        s = w.scale.repeat_interleave(FP8_BLOCK, 1)[:, :N].repeat_interleave(FP8_BLOCK, 2)[:, :, :K]
        return (w.q.float() * s).to(w.dtype)
    if isinstance(w, Int4Experts):        # each expert is a dense INT4 table transposed (K along rows)
        return torch.stack([dequantize_int4(q.T, s.T, z.T, INT4_GROUP).T
                            for q, s, z in zip(w.q, w.scale, w.zero)]).to(w.dtype)
    return w


@triton.jit
def load_weight_tile(row_ptrs, S, Z, rows, kk, k, mask, row_mask, stride_sn, DTYPE: tl.constexpr,
                     EMULATE_RNE: tl.constexpr, FMT: tl.constexpr, EVICT: tl.constexpr):
    """One weight tile, dequantized to DTYPE: row_ptrs points at each element's row of this expert's
    values (W + e * stride_we + rows * stride_wn), kk is its K offset within the tile (broadcast
    against rows), k the tile's first K; S / Z this expert's scales / zero points, stride_sn their
    row stride. mask: the tile's elements in range; row_mask: its rows in range."""
    if FMT == 2:        # INT4: word (k + kk) // 8, nibble (k + kk) % 8; one group per tile
        word = tl.load(row_ptrs + (k + kk) // 8, mask=mask, other=0, eviction_policy=EVICT)
        q = ((word >> (((k + kk) % 8) * 4)) & 0xF).to(tl.float32)
        s = tl.load(S + rows * stride_sn + k // 128, mask=row_mask, other=0.0).to(tl.float32)
        z = tl.load(Z + rows * stride_sn + k // 128, mask=row_mask, other=0.0).to(tl.float32)
        w = round_to((q - z) * s, DTYPE, EMULATE_RNE)
    else:
        w = tl.load(row_ptrs + k + kk, mask=mask, other=0.0, eviction_policy=EVICT)
        if FMT == 1:    # FP8: the 128 x 128 block's scale
            s = tl.load(S + (rows // 128) * stride_sn + k // 128, mask=row_mask, other=0.0)
            w = round_to(w.to(tl.float32) * s, DTYPE, EMULATE_RNE)
    return w


@triton.jit
def small_down_program(Experts, N, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr):
    """A small-path down kernel's program (every format's): its token t, BLOCK_N output columns (and
    their mask), and the token's top_k expert slots js (mask) and experts e."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    js = tl.arange(0, BLOCK_TK)
    j_mask = js < TOP_K
    pdl_wait(PDL)       # the hidden rows are the gate/up kernel's output
    e = tl.load(Experts + t * TOP_K + js, mask=j_mask, other=0).to(tl.int64)
    return t, offs_n, offs_n < N, js, j_mask, e


@triton.jit
def small_gate_up_program(Experts, inter, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """A small-path gate/up kernel's program (every format's): its (token, expert) pair, BLOCK_N
    columns of the intermediate (and their mask) and the pair's expert e."""
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pdl_wait(PDL)       # the experts are the router's, x the norm's
    e = tl.load(Experts + pair).to(tl.int64)
    return pair, offs_n, offs_n < inter, e
