"""Rotary position embedding on q and k, fused with the KV-cache write, in one launch (Triton).
Reference: `rope_write_kv_ref` below (apply_rotary_ref, then attention_ref.write_kv_ref).

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

`rope_write_kv` (what the engine runs, every layer) also writes the token's rotated k and its v
into the token's paged-cache slot, in the same program. In a batch-1 decode step each kernel is
mostly latency plus a gap before the next one, so rotary and a cache write as two kernels would
cost one launch and one gap per layer that this fusion removes; the rotated k is stored to the
cache straight from the registers that hold it (a separate write would re-read it), and v,
which is only copied, is loaded first so that its latency hides behind the rotation. One
program per token keeps the cache stores wide: a slot's row is kv_heads * head_dim contiguous
elements, stored as runs of head_dim/2. Splitting a token's heads
over several programs would put more SMs on a decode token, but its time is a chain of
dependent memory latencies (position -> cos/sin -> rotate -> store), not bandwidth, and the
chain is the same length in every program. At prefill sizes (thousands of tokens) the grid
fills the GPU and the kernel streams. The rotated q and k are still written as [T, H, d]
tensors: the prefill kernel reads the chunk's own k, v from them, not from the cache.

Rounding: everything is computed in fp32 from the fp32 tables and rounded once to q's dtype.
The reference instead rounds cos/sin to the input dtype and rounds after each bf16 op (two
products, one sum), so in bf16 the kernel is *more* accurate than the reference and they differ
by a few bf16 ulps of |x|; in fp32 they agree to fp32 rounding. The cache gets exactly the
rounded k that k_out gets, converted to the cache dtype, and v converted the same way.

q, k, v may be strided views (q, k and v split out of the QKV GEMM output): all strides are
passed, nothing is copied. Out-of-place by default; pass q_out=q, k_out=k to rotate in place
(each program loads both halves of a head before storing them). A negative slot (a padding
row, e.g. a CUDA-graph pad) is rotated like any row but writes nothing to the cache. Positions
must be < max_position (the runner guarantees it; the kernel cannot check without a host
sync). CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.attention_ref import write_kv_ref
from ridge.kernels.kv_fp8 import (check_kv_scales, dequantize_rows_ref, inverse_scale_from_bytes,
                                  quantize_rows_ref, scale_bytes_from_amax, scale_from_bytes)
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.rounding import e4m3_grid, emulate_rne, round_to


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                     sin_table: torch.Tensor):
    """q: [T, H, d], k: [T, kvh, d]; positions: [T]; tables [max_position, d] float32. Rounds
    cos/sin and every intermediate to the input dtype, as transformers does."""
    cos = cos_table[positions].to(q.dtype)[:, None, :]
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_ref(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x [..., d] @ the Hadamard rotation whose +-1 matrix is `signs` [d, d], then / sqrt(d):
    fp32 products of exact +-1 entries, rounded once to x's dtype (kv_fp8.hadamard_rotation)."""
    return ((x.float() @ signs.float()) * x.shape[-1] ** -0.5).to(x.dtype)


def rope_write_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_table: torch.Tensor, sin_table: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scales=None, rotation=None):
    """Rotate q, k (then, with `rotation`, the Hadamard rotation's +-1 matrix [d, d], rotate both
    by it) and write k and v into their cache slots (an FP8 cache: quantized, their scale bytes
    into kv_scales); returns (q, k, v) as attention must read them: for an FP8 cache k and v are
    the dequantized values the cache holds. The torch backend's rope_write_kv and the reference
    of the fused kernel."""
    q, k = apply_rotary_ref(positions, q, k, cos_table, sin_table)
    if rotation is not None:
        q, k = rotate_ref(q, rotation), rotate_ref(k, rotation)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    if kv_scales is not None:
        k, v = (dequantize_rows_ref(*quantize_rows_ref(x), x.dtype) for x in (k, v))
    return q, k, v


@triton.jit
def slot_row(Cache, slot, stride_cb, stride_ct, PAGE: tl.constexpr):
    """The cache row of a slot: page slot // PAGE, row slot % PAGE (slot >= 0)."""
    return Cache + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct


@triton.jit
def _row_amax(x, mask):
    return tl.max(tl.where(mask, tl.abs(x.to(tl.float32)), 0.0), axis=1)


@triton.jit
def _quantize(x, scale_bytes):
    """x [R, C] -> (e4m3 rows, their dequantized fp32 values) under the rows' scale bytes. The
    rounding is done on the fp32 grid (rounding.e4m3_grid), so the e4m3 conversion is exact and the
    dequantized values come from the rounded fp32, not from converting e4m3 back."""
    r = e4m3_grid(x.to(tl.float32) * inverse_scale_from_bytes(scale_bytes)[:, None])
    return r.to(tl.float8e4nv), r * scale_from_bytes(scale_bytes)[:, None]


@triton.jit
def cos_sin_row(Pos, tok, Cos, Sin, stride_cp, stride_cd, stride_sp, stride_sd, HALF: tl.constexpr,
                BLOCK_HALF: tl.constexpr):
    """Token tok's cos and sin, fp32 [1, BLOCK_HALF]: the first half of its position's table rows
    (the halves are equal, module docstring)."""
    pos = tl.load(Pos + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(Cos + pos * stride_cp + d * stride_cd, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sp + d * stride_sd, mask=d < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_heads(X, Out, tok, cos, sin, stride_xt, stride_xh, stride_xd, stride_ot, stride_oh, stride_od,
                 CacheRow, stride_ch, ScaleRow, stride_sh, to_cache, Signs, rsqrt_d,
                 H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 EMULATE_RNE: tl.constexpr, TO_CACHE: tl.constexpr, FP8: tl.constexpr, ROTATE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Rotate token `tok`'s H heads of X into Out; with TO_CACHE (k, not q), also store them into
    the cache slot whose row starts at CacheRow (last dim contiguous), where `to_cache` holds.
    ROTATE: then the Hadamard rotation, [o1 | o2] @ S / sqrt(d) = (o1 @ S_top + o2 @ S_bot) / sqrt(d)
    on the tensor cores in tf32 (exact for 16-bit inputs and S's +-1), and whole rows are stored. FP8: the cache
    gets e4m3 rows and a scale byte per head at ScaleRow, and Out the dequantized rows."""
    OUT: tl.constexpr = Out.dtype.element_ty
    d = tl.arange(0, BLOCK_HALF)[None, :]
    x_row = X + tok * stride_xt
    o_row = Out + tok * stride_ot
    if ROTATE:
        sr = tl.arange(0, BLOCK_HALF)[:, None]
        sc = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        s_mask = (sr < HALF) & (sc < 2 * HALF)
        s_top = tl.load(Signs + sr * (2 * HALF) + sc, mask=s_mask, other=0.0)
        s_bot = tl.load(Signs + (sr + HALF) * (2 * HALF) + sc, mask=s_mask, other=0.0)
    # unrolled (H is a constexpr): the next tile's loads can issue before this tile's stores
    for h0 in tl.static_range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (h < H) & (d < HALF)
        x1 = tl.load(x_row + h * stride_xh + d * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + h * stride_xh + (d + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
        o1 = round_to(x1 * cos - x2 * sin, OUT, EMULATE_RNE)
        o2 = round_to(x2 * cos + x1 * sin, OUT, EMULATE_RNE)
        if ROTATE:
            dd = tl.arange(0, 2 * BLOCK_HALF)[None, :]
            row_mask = (h < H) & (dd < 2 * HALF)
            # fp32 operands: a 16-bit value and +-1 are exact in tf32, so the products are exact
            r = (tl.dot(o1.to(tl.float32), s_top, input_precision=PRECISION)
                 + tl.dot(o2.to(tl.float32), s_bot, input_precision=PRECISION))
            r = round_to(r * rsqrt_d, OUT, EMULATE_RNE)
            if TO_CACHE:
                if FP8:
                    scale_bytes = scale_bytes_from_amax(_row_amax(r, row_mask))
                    rq, r32 = _quantize(r, scale_bytes)
                    tl.store(CacheRow + h * stride_ch + dd, rq, mask=row_mask & to_cache)
                    tl.store(ScaleRow + heads * stride_sh, scale_bytes.to(tl.uint8), mask=(heads < H) & to_cache)
                    r = r32.to(OUT)
                else:
                    tl.store(CacheRow + h * stride_ch + dd, r.to(CacheRow.dtype.element_ty), mask=row_mask & to_cache)
            tl.store(o_row + h * stride_oh + dd * stride_od, r, mask=row_mask)
        else:
            if TO_CACHE:
                if FP8:
                    scale_bytes = scale_bytes_from_amax(tl.maximum(_row_amax(o1, mask), _row_amax(o2, mask)))
                    q1, o1_32 = _quantize(o1, scale_bytes)
                    q2, o2_32 = _quantize(o2, scale_bytes)
                    tl.store(ScaleRow + heads * stride_sh, scale_bytes.to(tl.uint8), mask=(heads < H) & to_cache)
                    o1, o2 = o1_32.to(OUT), o2_32.to(OUT)
                else:
                    q1, q2 = o1.to(CacheRow.dtype.element_ty), o2.to(CacheRow.dtype.element_ty)
                tl.store(CacheRow + h * stride_ch + d, q1, mask=mask & to_cache)
                tl.store(CacheRow + h * stride_ch + d + HALF, q2, mask=mask & to_cache)
            tl.store(o_row + h * stride_oh + d * stride_od, o1, mask=mask)
            tl.store(o_row + h * stride_oh + (d + HALF) * stride_od, o2, mask=mask)


@triton.jit
def _rope_kv_write_kernel(Q, K, V, QOut, KOut, VOut, Pos, Cos, Sin, KCache, VCache, KScale, VScale, Slots, Signs,
                          rsqrt_d, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                          stride_vt, stride_vh, stride_vd,
                          stride_qot, stride_qoh, stride_qod, stride_kot, stride_koh, stride_kod,
                          stride_vot, stride_voh, stride_cp, stride_cd, stride_sp, stride_sd,
                          stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                          stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                          HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_KVH: tl.constexpr, EMULATE_RNE: tl.constexpr, PDL: tl.constexpr,
                          FP8: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)   # q, k, v come from the QKV GEMM just before (ridge/kernels/pdl.py)
    slot = tl.load(Slots + tok).to(tl.int64)
    # True & (...) keeps the flag boolean: Triton 3.9's interpreter stores a scalar
    # comparison as int32, which it then refuses as a mask
    to_cache = True & (slot >= 0)
    k_row = slot_row(KCache, slot, stride_kcb, stride_kct, PAGE)
    # v is only copied: its load is issued first and its store comes last, so its memory
    # latency overlaps the cos/sin gather and the rotation instead of adding to them
    hv = tl.arange(0, BLOCK_KVH)[:, None]
    dv = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    v_ok = (hv < HK) & (dv < 2 * HALF)
    v_mask = v_ok & to_cache
    v = tl.load(V + tok * stride_vt + hv * stride_vh + dv * stride_vd, mask=v_ok if FP8 else v_mask, other=0.0)
    cos, sin = cos_sin_row(Pos, tok, Cos, Sin, stride_cp, stride_cd, stride_sp, stride_sd, HALF, BLOCK_HALF)
    rotate_heads(Q, QOut, tok, cos, sin, stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, stride_qod,
                 QOut, 0, QOut, 0, False, Signs, rsqrt_d, HQ, HALF, BLOCK_HQ, BLOCK_HALF, EMULATE_RNE, False, False,
                 ROTATE, PRECISION)
    rotate_heads(K, KOut, tok, cos, sin, stride_kt, stride_kh, stride_kd, stride_kot, stride_koh, stride_kod,
                 k_row, stride_kch, slot_row(KScale, slot, stride_ksb, stride_kst, PAGE), stride_ksh, to_cache, Signs,
                 rsqrt_d, HK, HALF, BLOCK_HK, BLOCK_HALF, EMULATE_RNE, True, FP8, ROTATE, PRECISION)
    v_row = slot_row(VCache, slot, stride_vcb, stride_vct, PAGE)
    if FP8:
        # every row, padding included, gets its dequantized v: attention reads it like the cache's
        scale_bytes = scale_bytes_from_amax(_row_amax(v, v_ok))
        vq, v32 = _quantize(v, scale_bytes)
        tl.store(v_row + hv * stride_vch + dv, vq, mask=v_mask)
        heads = tl.arange(0, BLOCK_KVH)
        tl.store(slot_row(VScale, slot, stride_vsb, stride_vst, PAGE) + heads * stride_vsh, scale_bytes.to(tl.uint8),
                 mask=(heads < HK) & to_cache)
        tl.store(VOut + tok * stride_vot + hv * stride_voh + dv, v32.to(VOut.dtype.element_ty), mask=v_ok)
    else:
        tl.store(v_row + hv * stride_vch + dv, v.to(VCache.dtype.element_ty), mask=v_mask)


def launch_config(q_heads: int, k_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_HALF, BLOCK_HQ, BLOCK_HK, num_warps): tiles of ~2K elements per half
    (32 heads x 64 for Llama-8B q), 4 warps -> 16 elements per thread per half in flight."""
    block_half = triton.next_power_of_2(head_dim // 2)
    cap = max(1, 2048 // block_half)
    block_hq = min(triton.next_power_of_2(q_heads), cap)
    block_hk = min(triton.next_power_of_2(k_heads), cap)
    num_warps = max(1, min(8, block_hq * block_half // 512))
    return block_half, block_hq, block_hk, num_warps


def rope_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, rotation: torch.Tensor | None = None,
                  q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """Rotate q [T, H, d] and k [T, kvh, d] (any strides) and write the rotated k and v
    [T, kvh, d] into k_cache, v_cache [pages, page, kvh, d] at slot_mapping [T] (negative:
    skipped); positions: [T] int; cos, sin: [max_pos, d] with equal halves. An FP8 cache
    (ridge/kernels/kv_fp8.py) needs kv_scales, the caches' scale bytes [pages, page, kvh];
    `rotation` (kv_fp8.hadamard_signs, [d, d]) rotates q and k after RoPE. Returns (q_out, k_out,
    v_out): what attention reads, k and v as the cache holds them (dequantized for FP8; v itself
    otherwise); q_out, k_out contiguous unless given."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rope_write_kv: q [T, H, d] and k [T, kvh, d] expected, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"rope_write_kv: head_dim {head_dim} must be even and match the tables' {cos.shape[-1]}")
    if positions.shape != (tokens,):
        raise ValueError(f"rope_write_kv: positions must be [T={tokens}], got {tuple(positions.shape)}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError("rope_write_kv: q_out/k_out must have q's/k's shape")
    if v.shape != k.shape:
        raise ValueError(f"rope_write_kv: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_write_kv: caches [pages, page, {k.shape[1]}, {k.shape[2]}] expected, "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_write_kv needs caches whose last dim is contiguous")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"rope_write_kv: slot_mapping must be [T={tokens}], got {tuple(slot_mapping.shape)}")
    fp8 = check_kv_scales(k_cache, v_cache, kv_scales) is not None
    if rotation is not None and (rotation.shape != (head_dim, head_dim) or head_dim & (head_dim - 1)):
        raise ValueError(f"rope_write_kv: rotation must be [{head_dim}, {head_dim}] with head_dim a power of two, "
                         f"got {tuple(rotation.shape)}")
    v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if fp8 else v
    if tokens == 0:
        return q_out, k_out, v_out
    block_half, block_hq, block_hk, num_warps = launch_config(q_heads, k_heads, head_dim)
    if rotation is not None:       # the rotation's tl.dot needs 16 rows and a K of 16 a tile (masked)
        block_half, block_hq, block_hk = max(block_half, 16), max(block_hq, 16), max(block_hk, 16)
    k_scale, v_scale = kv_scales if fp8 else (k_cache, v_cache)
    signs = rotation.to(device=q.device, dtype=torch.float32).contiguous() if rotation is not None else q
    pdl = use_pdl(q)
    _rope_kv_write_kernel[(tokens,)](
        q, k, v, q_out, k_out, v_out, positions, cos, sin, k_cache, v_cache, k_scale, v_scale, slot_mapping, signs,
        head_dim ** -0.5, *q.stride(), *k.stride(), *v.stride(), *q_out.stride(), *k_out.stride(),
        *v_out.stride()[:2], *cos.stride(), *sin.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *k_scale.stride()[:3], *v_scale.stride()[:3],
        HQ=q_heads, HK=k_heads, HALF=head_dim // 2, PAGE=k_cache.shape[1],
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        BLOCK_KVH=triton.next_power_of_2(k_heads), EMULATE_RNE=emulate_rne(q), PDL=pdl,
        FP8=fp8, ROTATE=rotation is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, **launch_options(pdl))
    return q_out, k_out, v_out
