"""Multi-head Latent Attention over a paged latent cache (DeepSeek-V2/V3): the reference.

Layout of one layer's cache: [num_pages, page_size, 1, kv_lora_rank + rope_dim], a token's row
being its normalised KV latent c (kv_lora_rank) then its rotated key part k_pe (rope_dim), shared
by every head: slots, pages and page tables exactly as the per-head cache's
(ridge/kernels/attention_ref.py), one "head" wide.

Head h's key and value are up-projections of the latent: [k_nope_h; v_h] = W_kv_b[h] c, and its
key is [k_nope_h, k_pe]. `mla_attention_ref` expands every cached latent that way and attends as
transformers does (the expanded K/V rounded to the model dtype) - the readable oracle.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.attention_ref import causal_attention_ref
from ridge.kernels.decode_attention import _INTERPRET, _MAX_SPLITS, _device_sms, _merge_kernel, choose_num_splits
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.prefill_attention import _LOG2E
from ridge.kernels.rotary import apply_rotary_ref, cos_sin_row, launch_config, rotate_heads, slot_row
from ridge.kernels.rounding import emulate_rne


def rope_write_latent_ref(positions: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q_pe [T, H, rope] and k_pe [T, rope] (apply_rotary_ref: transformers' rounding) and scatter
    the new tokens' [latent, rotated k_pe] rows ([T, r], [T, rope]) into their cache slots (a
    negative slot: a padding row, not written) -> the rotated q_pe."""
    q_pe, k_rot = apply_rotary_ref(positions, q_pe, k_pe[:, None], cos, sin)
    keep = slot_mapping >= 0
    rows = torch.cat((latent, k_rot[:, 0]), dim=-1)[keep].to(cache.dtype)
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping[keep], rows)
    return q_pe


@triton.jit
def _rope_write_latent_kernel(QPe, QOut, KPe, KOut, Latent, Pos, Cos, Sin, Cache, Slots, stride_qt, stride_qh,
                              stride_qd, stride_qot, stride_qoh, stride_qod, stride_kt, stride_kd, stride_lt,
                              stride_cp, stride_cd, stride_sp, stride_sd, stride_cb, stride_ct, H: tl.constexpr,
                              R: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, EMULATE_RNE: tl.constexpr,
                              PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)       # q_pe, the latent and k_pe come from the projections just before
    slot = tl.load(Slots + tok).to(tl.int64)
    to_cache = True & (slot >= 0)           # a boolean even in Triton 3.9's interpreter (rotary.py)
    row = slot_row(Cache, slot, stride_cb, stride_ct, PAGE)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(Latent + tok * stride_lt + offs_r, mask=offs_r < R, other=0.0)   # only copied: issued first
    cos, sin = cos_sin_row(Pos, tok, Cos, Sin, stride_cp, stride_cd, stride_sp, stride_sd, HALF, BLOCK_HALF)
    rotate_heads(QPe, QOut, tok, cos, sin, stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, stride_qod,
                 QOut, 0, QOut, 0, False, QOut, 1.0, H, HALF, BLOCK_H, BLOCK_HALF, EMULATE_RNE, False, False, False,
                 "ieee")
    # the shared key part: one "head", its rotated row stored into the slot after the latent
    rotate_heads(KPe, KOut, tok, cos, sin, stride_kt, 0, stride_kd, 2 * HALF, 0, 1, row + R, 0, row, 0, to_cache,
                 KOut, 1.0, 1, HALF, 1, BLOCK_HALF, EMULATE_RNE, True, False, False, "ieee")
    tl.store(row + offs_r, c.to(Cache.dtype.element_ty), mask=(offs_r < R) & to_cache)


def rope_write_latent(positions: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """rope_write_latent_ref in one launch, one program a token (ridge/kernels/rotary.py's design:
    the cos/sin row gathered once for the query's heads and the shared key, the rotated key stored
    from registers), with no host-side look at the slots (a CUDA graph holds it). The rotation is
    computed in fp32 and rounded once, as rope_write_kv's: a few ulps from the reference in bf16.
    q_pe, latent and k_pe may be strided views of the projections' outputs."""
    T, H, rope = q_pe.shape
    R = latent.shape[-1]
    if rope % 2 or k_pe.shape != (T, rope) or latent.shape != (T, R) or cache.shape[-1] != R + rope:
        raise ValueError(f"rope_write_latent: q_pe [T, H, rope] (rope even), k_pe [T, rope], latent [T, r] and a cache "
                         f"of rows r + rope expected, got {tuple(q_pe.shape)}, {tuple(k_pe.shape)}, "
                         f"{tuple(latent.shape)}, {tuple(cache.shape)}")
    if cos.shape[-1] != rope or sin.shape != cos.shape or positions.shape != (T,) or slot_mapping.shape != (T,):
        raise ValueError(f"rope_write_latent: cos/sin [max_pos, {rope}] and positions, slots [T={T}] expected")
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    if T == 0:
        return q_out
    k_out = torch.empty(T, rope, dtype=k_pe.dtype, device=k_pe.device)   # the kernel's rows; the cache is read
    block_half, block_h, _, num_warps = launch_config(H, 1, rope)
    pdl = use_pdl(q_pe)
    _rope_write_latent_kernel[(T,)](
        q_pe, q_out, k_pe, k_out, latent, positions, cos, sin, cache, slot_mapping, *q_pe.stride(), *q_out.stride(),
        *k_pe.stride(), latent.stride(0), *cos.stride(), *sin.stride(), cache.stride(0), cache.stride(1), H=H, R=R,
        HALF=rope // 2, PAGE=cache.shape[1], BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_R=triton.next_power_of_2(R), EMULATE_RNE=emulate_rne(q_pe), PDL=pdl, num_warps=num_warps,
        **launch_options(pdl))
    return q_out


def mla_attention_ref(q: torch.Tensor, cache: torch.Tensor, kv_b_weight: torch.Tensor, meta: AttentionMetadata,
                      scale: float, nope_dim: int, v_dim: int) -> torch.Tensor:
    """q [T, H, nope_dim + rope_dim] (its rope part rotated), kv_b_weight [H * (nope_dim + v_dim),
    kv_lora_rank] -> [T, H, v_dim]: causal attention of each sequence's queries over its cached
    latents, expanded to per-head K and V."""
    H, r = q.shape[1], kv_b_weight.shape[1]
    page_size = cache.shape[1]
    out = q.new_empty(q.shape[0], H, v_dim)
    starts = meta.query_start_loc_cpu
    for i, ctx_len in enumerate(meta.seq_lens_cpu):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        pages = meta.page_tables[i, :(ctx_len + page_size - 1) // page_size].long()
        rows = cache[pages].reshape(-1, cache.shape[-1])[:ctx_len]
        kv = F.linear(rows[:, :r].to(kv_b_weight.dtype), kv_b_weight).view(ctx_len, H, nope_dim + v_dim)
        k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
        k = torch.cat((k_nope, rows[:, None, r:].to(kv.dtype).expand(-1, H, -1)), dim=-1)
        out[q_lo:q_hi] = causal_attention_ref(q[q_lo:q_hi].float(), k.float(), v.float(), scale).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Decode in the absorbed form (Triton).
#
# Head h's score against key t is q_nope_h . (W_UK_h c_t) + q_pe_h . k_pe_t = (W_UK_h^T q_nope_h) . c_t
# + q_pe_h . k_pe_t, and its output W_UV_h sum_t p_t c_t. So with q_lat = W_UK^T q_nope (a batched
# GEMM before, [H, nope] x [nope, r] a token) and the output's W_UV applied after, attention runs
# on the cached rows themselves: every head reads the same [c, k_pe] row, so one program holds
# BLOCK_H heads as the M side of tl.dot and streams each latent tile once for all of them - GQA
# with a single kv head and r + rope wide keys whose first r dims are also the values. Decode is
# bound by those bytes ((r + rope) x 2 a token a layer); split-KV (flash-decoding) fills the GPU
# at small batch, and decode_attention's merge kernel combines the splits.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_kernel(QLat, QPe, Cache, Out, O_part, Lse, page_tables, query_start_loc, seq_lens, qk_scale,
                       num_splits, num_heads, stride_qt, stride_qh, stride_pt, stride_ph, stride_cb, stride_ct,
                       stride_ot, stride_oh, stride_bt, R: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                       KEYS_MAJOR: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pdl_wait(PDL)
    q_row = tl.load(query_start_loc + seq)
    if tl.load(query_start_loc + seq + 1) == q_row:      # padding slot: no query this step
        return
    ctx_len = tl.load(seq_lens + seq)
    chunk = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx_len)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_r, offs_p, offs_n = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_ROPE), tl.arange(0, BLOCK_N)
    r_ok, p_ok = offs_r < R, offs_p < ROPE
    q_lat = tl.load(QLat + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(QPe + q_row.to(tl.int64) * stride_pt + heads[:, None] * stride_ph + offs_p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    bt_row = page_tables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if KEYS_MAJOR:      # the keys as the dots' M side: [N, r] x [r, H] and [r, N] x [N, H]
        q_lat_t, q_pe_t = tl.trans(q_lat), tl.trans(q_pe)
        acc_t = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        k_idx = start_n + offs_n
        k_ok = k_idx < end
        page = tl.load(bt_row + k_idx // PAGE, mask=k_ok, other=0).to(tl.int64)
        row = Cache + page[:, None] * stride_cb + (k_idx % PAGE).to(tl.int64)[:, None] * stride_ct
        c = tl.load(row + offs_r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)       # [N, R]
        k_pe = tl.load(row + R + offs_p[None, :], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        if KEYS_MAJOR:
            qk_t = tl.dot(c, q_lat_t, input_precision=PRECISION)
            qk_t = tl.dot(k_pe, q_pe_t, qk_t, input_precision=PRECISION) * qk_scale           # log2 domain
            qk_t = tl.where(k_ok[:, None], qk_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk_t, 0))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_new)
            p_t = tl.math.exp2(qk_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p_t, 0)
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(c), p_t.to(c.dtype), input_precision=PRECISION)
        else:
            qk = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            qk = tl.dot(q_pe, tl.trans(k_pe), qk, input_precision=PRECISION) * qk_scale     # log2 domain
            qk = tl.where(k_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new
    if KEYS_MAJOR:
        acc = tl.trans(acc_t)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DIRECT:
        tl.store(Out + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
                 out.to(Out.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    else:   # an empty split: out 0, lse -inf, no weight in the merge
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part = (seq * num_heads + heads).to(tl.int64) * num_splits + split
        tl.store(O_part + part[:, None] * R + offs_r[None, :], out, mask=h_ok[:, None] & r_ok[None, :])
        tl.store(Lse + part, lse, mask=h_ok)


def mla_num_splits(batch: int, head_blocks: int, max_seq_len: int, num_warps: int, device: torch.device) -> int:
    """Split-KV programs for the absorbed decode: one program a (sequence, head block, split).

    Unlike GQA's, every split here writes a whole head block's partial output (BLOCK_H x r fp32,
    read back by the merge: 16 heads x 2 KB against 1.1 KB a cached token), so more splits than
    fill the SMs cost bytes. Measured (benchmarks/mla.py --sweep-splits, BENCHMARKS.md): the
    latent stream saturates an SM with two 4-warp programs or one 8-warp program, so as many
    splits as give every SM that many, at least two (a shorter tail), and no split under 256
    keys - 128 when the whole batch is one or two program rows and only latency counts."""
    if device.type != "cuda" or _INTERPRET:
        return choose_num_splits(batch, head_blocks, max_seq_len, device)
    rows = batch * head_blocks
    per_sm = 2 if num_warps <= 4 else 1
    splits = max(per_sm * _device_sms(device) // rows, 2)
    return max(1, min(splits, _MAX_SPLITS, max_seq_len // (128 if rows <= 2 else 256)))


class MLADecodeTiles(NamedTuple):
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    keys_major: bool = False


def mla_decode_tiles(num_heads: int, batch: int) -> MLADecodeTiles:
    """Measured (benchmarks/mla.py; BENCHMARKS.md), each form where it wins: at V3's 128 heads, 64
    heads a program with 8 warps (fewer re-reads of each latent tile) and 64 keys as the dots' M
    side (the tensor cores' 64-row instructions fed from shared memory); at V2-Lite's 16, 16 heads
    a program, heads-major over 32-key tiles from batch 8 on (the [16, 512] accumulator in 4
    warps' registers, 3 stages in flight), the keys-major form at batch 1."""
    if num_heads >= 64:
        return MLADecodeTiles(64, 64, 8, 2, True)
    return MLADecodeTiles(16, 64, 4, 3, True) if batch <= 4 else MLADecodeTiles(16, 32, 4, 3)


def mla_decode_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, num_splits: int | None = None,
                         tiles: MLADecodeTiles | None = None) -> torch.Tensor:
    """One query token a sequence: q_lat [B, H, r] (q_nope absorbed into the latent space), q_pe
    [B, H, rope] (rotated), cache [pages, page, 1, r + rope] -> the attention-weighted latents
    [B, H, r] (W_UV turns them into the heads' values)."""
    if meta.max_query_len > 1:
        raise ValueError("mla_decode_attention needs max_query_len <= 1; use mla_attention_ref")
    B, H, R = q_lat.shape
    rope = q_pe.shape[2]
    if R & (R - 1):
        raise ValueError(f"mla_decode_attention: kv_lora_rank must be a power of two, got {R}")
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != R + rope or cache.stride(3) != 1:
        raise ValueError(f"mla_decode_attention: cache {tuple(cache.shape)} is not [pages, page, 1, {R} + {rope}] "
                         f"contiguous in its last dim")
    out = q_lat.new_empty(B, H, R)
    batch = meta.num_seqs
    if B == 0 or batch == 0:
        return out
    block_h, block_n, warps, stages, keys_major = tiles or mla_decode_tiles(H, batch)
    page = cache.shape[1]
    if num_splits is None:
        num_splits = mla_num_splits(batch, triton.cdiv(H, block_h), meta.max_seq_len, warps, q_lat.device)
    o_part = lse = out
    if num_splits > 1:
        o_part = torch.empty(batch * H * num_splits * R, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(batch * H * num_splits, dtype=torch.float32, device=q_lat.device)
    pdl = use_pdl(q_lat)
    bt = meta.page_tables
    _mla_decode_kernel[(batch, triton.cdiv(H, block_h), num_splits)](
        q_lat, q_pe, cache, out, o_part, lse, bt, meta.query_start_loc, meta.seq_lens, scale * _LOG2E, num_splits,
        H, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        out.stride(0), out.stride(1), bt.stride(0), R=R, ROPE=rope, BLOCK_R=triton.next_power_of_2(R),
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=block_n, PAGE=page,
        KEYS_MAJOR=keys_major, DIRECT=num_splits == 1,
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=warps, num_stages=stages,
        **launch_options(pdl))
    if num_splits > 1:
        _merge_kernel[(batch, H)](out, o_part, lse, meta.query_start_loc, num_splits, out.stride(0), out.stride(1),
                                  HEAD_DIM=R, SPLITS_P2=triton.next_power_of_2(num_splits), PDL=pdl, num_warps=4,
                                  **launch_options(pdl))
    return out


def absorb_query(q_nope: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] -> q_lat [T, H, r] = W_UK_h^T q_nope_h, one batched GEMM over heads
    (kv_b_weight [H (nope + v), r]: each head's nope rows, then its v rows)."""
    T, H, nope = q_nope.shape
    w_uk = kv_b_weight.view(H, -1, kv_b_weight.shape[1])[:, :nope]              # [H, nope, r]
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def unabsorb_output(o_lat: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> torch.Tensor:
    """o_lat [T, H, r] -> [T, H, v] = W_UV_h o_lat_h."""
    T, H, r = o_lat.shape
    w_uv = kv_b_weight.view(H, -1, r)[:, nope:]                                   # [H, v, r]
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
