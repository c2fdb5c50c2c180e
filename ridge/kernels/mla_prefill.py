"""Multi-head Latent Attention's prefill in the expanded form (Triton): each sequence's cached
latents are up-projected to per-head K and V once for the step, then FlashAttention-style tiled
attention runs over them as prefill_attention's kernel does (online softmax in exp2, one
[BLOCK_M] query tile of one head a program, the heaviest causal tiles first).

Why expanded and not absorbed here: a prefill chunk has many query rows per cached row, so the
work is the score and value GEMMs, not the bytes of the cache. Absorbed, every score would be a
dot product over r + rope = 576 dims for each head; expanded it is nope + rope = 192, and the
values are 128 wide instead of 512, about 3x fewer tensor-core FLOPs a (query, key) pair. The
expansion (one GEMM of the context's latents by W_kv_b) is paid once a step for all query rows.

What differs from the per-head kernel:
  * the query/key head dim is nope + rope = 192, not a power of two: the score is two tl.dot's,
    q_nope . k_nope (128 wide) plus q_pe . k_pe (64 wide), and k_pe is one row a token shared by
    every head (MQA-like: the same [BLOCK_N, rope] tile for all heads);
  * the values are v_dim wide (128), narrower than the keys;
  * the context (cached prefix and the chunk's own keys alike) is the contiguous expanded
    tensor, read through tensor descriptors (TMA on Hopper): row j of sequence s's context is key
    position j, and query row i (local) sits at position prefix + i.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.prefill_attention import (_INTERPRET, _LOG2E, _descriptor_scratch, _head_rows, _softmax_fold,
                                             _tma_ready)


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # 64-row tiles keep the [64, 128] fp32 accumulator and the 192-wide query in registers with 4
    # warps (one warpgroup, one wgmma row block); 2-3 stages prefetch the next K/V tiles by TMA.
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3))]


@triton.autotune(configs=_configs(), key=["NOPE", "ROPE", "V_DIM"], cache_results=True)
@triton.jit
def _mla_prefill_kernel(Q, KNope, KPe, V, Out, query_start_loc, context_start_loc, seq_lens, qk_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh,
                        stride_ot, stride_oh, NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    n_mblocks = tl.cdiv(q_len, BLOCK_M)
    if pid_m >= n_mblocks:
        return
    m_block = n_mblocks - 1 - pid_m
    ctx_len = tl.load(seq_lens + seq)
    prefix = ctx_len - q_len
    k_start = tl.load(context_start_loc + seq)
    qn_desc = _head_rows(Q, q_start, head * stride_qh, stride_qt, q_len, BLOCK_M, NOPE)
    qp_desc = _head_rows(Q, q_start, head * stride_qh + NOPE, stride_qt, q_len, BLOCK_M, ROPE)
    o_desc = _head_rows(Out, q_start, head * stride_oh, stride_ot, q_len, BLOCK_M, V_DIM)
    kn_desc = _head_rows(KNope, k_start, head * stride_kh, stride_kt, ctx_len, BLOCK_N, NOPE)
    kp_desc = _head_rows(KPe, k_start, 0, stride_pt, ctx_len, BLOCK_N, ROPE)
    v_desc = _head_rows(V, k_start, head * stride_vh, stride_vt, ctx_len, BLOCK_N, V_DIM)

    first_q = m_block * BLOCK_M
    q_pos = prefix + first_q + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_nope = qn_desc.load([first_q, 0])
    q_pe = qp_desc.load([first_q, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], tl.float32)
    visible_to_all = (prefix + first_q + 1) // BLOCK_N * BLOCK_N      # keys every row of the tile sees
    for start_n in range(0, visible_to_all, BLOCK_N):
        qk = tl.dot(q_nope, tl.trans(kn_desc.load([start_n, 0])), input_precision=PRECISION)
        qk = tl.dot(q_pe, tl.trans(kp_desc.load([start_n, 0])), qk, input_precision=PRECISION)
        acc, l_i, m_i = _softmax_fold(acc, l_i, m_i, qk, v_desc.load([start_n, 0]), qk_scale, start_n + offs_n,
                                      q_pos, ctx_len, 0, False, False, False, PRECISION)
    diag_end = tl.minimum(prefix + first_q + BLOCK_M, ctx_len)
    for start_n in range(visible_to_all, diag_end, BLOCK_N):
        qk = tl.dot(q_nope, tl.trans(kn_desc.load([start_n, 0])), input_precision=PRECISION)
        qk = tl.dot(q_pe, tl.trans(kp_desc.load([start_n, 0])), qk, input_precision=PRECISION)
        acc, l_i, m_i = _softmax_fold(acc, l_i, m_i, qk, v_desc.load([start_n, 0]), qk_scale, start_n + offs_n,
                                      q_pos, ctx_len, 0, True, False, False, PRECISION)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o_desc.store([first_q, 0], (acc / l_i[:, None]).to(Out.dtype.element_ty))


def gather_context(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's cached rows, positions 0 .. seq_len - 1, one after another: [C, r + rope]
    and the offsets [B + 1] (int32, on the cache's device) of each sequence's first row. No
    host-side loop over tokens: the slots come from the page tables in one indexing pass."""
    device, page = cache.device, cache.shape[1]
    starts = torch.tensor([0, *itertools.accumulate(meta.seq_lens_cpu)], dtype=torch.int32, device=device)
    total = sum(meta.seq_lens_cpu)
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), meta.seq_lens.long(), output_size=total)
    pos = torch.arange(total, device=device) - starts[seq]
    slots = meta.page_tables[seq, pos // page].long() * page + pos % page
    return cache.view(-1, cache.shape[-1])[slots], starts


def mla_prefill_attention(q: torch.Tensor, cache: torch.Tensor, kv_b_weight: torch.Tensor, meta: AttentionMetadata,
                          scale: float, nope_dim: int, v_dim: int) -> torch.Tensor:
    """mla_attention_ref's contract (q [T, H, nope + rope], its rope part rotated; the step's rows
    already in the cache) -> [T, H, v_dim], with the context expanded once and the attention in
    Triton. Any mix of chunk lengths and cached prefixes, decode rows included."""
    T, H, qk_dim = q.shape
    rope, r = qk_dim - nope_dim, kv_b_weight.shape[1]
    for name, d in (("qk_nope_head_dim", nope_dim), ("qk_rope_head_dim", rope), ("v_head_dim", v_dim)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"mla_prefill_attention: {name}={d} must be a power of two >= 16")
    if cache.shape[-1] != r + rope or kv_b_weight.shape[0] != H * (nope_dim + v_dim):
        raise ValueError(f"mla_prefill_attention: q {tuple(q.shape)}, cache {tuple(cache.shape)} and kv_b "
                         f"{tuple(kv_b_weight.shape)} do not fit together")
    out = q.new_empty(T, H, v_dim)
    if T == 0 or meta.num_seqs == 0:
        return out
    rows, context_start = gather_context(cache, meta)
    kv = F.linear(rows[:, :r].to(kv_b_weight.dtype), kv_b_weight).view(-1, H, nope_dim + v_dim)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k_pe = rows[:, r:].to(q.dtype)
    q = _tma_ready(q)
    triton.set_allocator(_descriptor_scratch)
    grid = lambda META: (triton.cdiv(meta.max_query_len, META["BLOCK_M"]), H, meta.num_seqs)
    _mla_prefill_kernel[grid](
        q, k_nope, k_pe, v, out, meta.query_start_loc, context_start, meta.seq_lens, scale * _LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), k_pe.stride(0), kv.stride(0), kv.stride(1),
        out.stride(0), out.stride(1), NOPE=nope_dim, ROPE=rope, V_DIM=v_dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
