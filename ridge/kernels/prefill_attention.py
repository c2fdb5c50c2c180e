"""Prefill / chunked-prefill attention over the paged KV cache (FlashAttention-2 style, Triton).

One program owns a BLOCK_M tile of one sequence's query rows for one query head. The Q tile stays
in registers; K/V tiles of BLOCK_N keys stream through shared memory, gathered row by row through
the block table (a key row is head_dim contiguous elements, so every row is one wide coalesced
load even though consecutive keys may live on different physical pages). Softmax is computed
online (running max m, running sum l) so the [M, N] score tile never leaves the chip, and the
result is divided by l once at the end.

The new tokens' K/V are already in the cache (write_kv ran first), so the prefix (cached pages,
earlier chunks) and the chunk's own keys are read the same way; the query rows are the last q_len
positions of the seq_len context. Tiles entirely left of the diagonal need no mask and run in a
mask-free loop; the few tiles straddling the diagonal run in a second, masked loop; tiles right
of the diagonal (fully masked) are never visited.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ridge.kernels.attention_meta import AttentionMetadata

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634


def _fix_interpreter_loop_bounds() -> None:
    """triton-lang/triton#9171: with numpy >= 2.4 the interpreter cannot use a loaded scalar as a
    `range` bound (int() of a 1-element array). Re-patch tensor.__index__ to take the element."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_ridge_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ridge_fixed = True
    interpreter._patch_lang_tensor = patched


if _INTERPRET:
    _fix_interpreter_loop_bounds()


def _configs() -> list[triton.Config]:
    if _INTERPRET:  # autotuning under the CPU interpreter would run every config: use one small one
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # Hopper: BLOCK_M=128 gives the wgmma units a full 64-row instruction per warpgroup (8 warps =
    # 2 warpgroups); BLOCK_N 64/128 amortises the softmax bookkeeping per tile; 2-3 stages of
    # cp.async prefetch hide HBM latency behind the two tensor-core GEMMs of the previous tile.
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def _prune(configs, named_args, **kwargs):
    d = {**named_args, **kwargs}["HEAD_DIM"]
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        acc_regs = bm * d // (32 * c.num_warps)                 # fp32 accumulator regs per thread
        smem = 2 * (bm * d + (c.num_stages - 1) * 2 * bn * d)   # bf16 Q + K/V tiles in flight
        # 8 warps = 2 warpgroups only pay off with a 128-row tile (wgmma is 64 rows per group);
        # a 128x32 tile spends more on softmax bookkeeping than on the two GEMMs.
        useful = (bm == 128) == (c.num_warps == 8) and not (bm == 128 and bn == 32)
        if acc_regs <= 128 and smem <= 200 * 1024 and useful:
            keep.append(c)
    return keep or configs[:1]


@triton.jit
def _attend_tile(acc, l_i, m_i, q, start_n, q_pos, ctx_len, window, qk_scale,
                 K, V, bt_row, offs_n, offs_d, stride_kb, stride_kt, stride_vb, stride_vt,
                 PAGE: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
                 PRECISION: tl.constexpr):
    k_idx = start_n + offs_n
    # Gather through the block table: key k lives at row k % PAGE of physical page bt[k // PAGE].
    if MASKED:
        k_ok = k_idx < ctx_len
        page = tl.load(bt_row + k_idx // PAGE, mask=k_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + k_idx // PAGE).to(tl.int64)
    row = (k_idx % PAGE).to(tl.int64)
    k_ptrs = K + page[:, None] * stride_kb + row[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + page[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=k_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    # Scores pre-multiplied by scale*log2(e): the softmax then uses exp2, a single MUFU.EX2 op,
    # instead of exp (an extra multiply per element on the critical path).
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(k_idx[None, :] <= q_pos[:, None], qk, float("-inf"))
    if SLIDING:
        qk = tl.where(k_idx[None, :] > q_pos[:, None] - window, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if SLIDING:  # a row may have seen no visible key yet: keep exp2 away from (-inf) - (-inf)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "PAGE", "SLIDING"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _prefill_kernel(Q, K, V, Out, block_tables, query_start_loc, seq_lens, qk_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    n_mblocks = tl.cdiv(q_len, BLOCK_M)
    if pid_m >= n_mblocks:  # the grid is sized for the longest chunk in the batch
        return
    # Launch the heaviest (bottom, most keys) causal tiles first so short ones fill the tail wave.
    m_block = n_mblocks - 1 - pid_m
    ctx_len = tl.load(seq_lens + seq)
    prefix = ctx_len - q_len
    kv_head = head // GROUP  # GQA / MQA

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_pos = prefix + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    K_h = K + kv_head * stride_kh
    V_h = V + kv_head * stride_vh

    first_q = prefix + m_block * BLOCK_M
    last_q = tl.minimum(first_q + BLOCK_M, ctx_len) - 1
    # Keys [lo, full_end) are visible to every row of the tile (below the diagonal): no causal mask.
    full_end = (first_q + 1) // BLOCK_N * BLOCK_N
    lo = 0
    if SLIDING:  # tiles entirely left of every row's window are skipped
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, start_n, q_pos, ctx_len, window, qk_scale,
                                     K_h, V_h, bt_row, offs_n, offs_d, stride_kb, stride_kt,
                                     stride_vb, stride_vt, PAGE, False, SLIDING, PRECISION)
    # Diagonal tiles: causal mask (and key < ctx_len) applied.
    for start_n in range(full_end, last_q + 1, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, start_n, q_pos, ctx_len, window, qk_scale,
                                     K_h, V_h, bt_row, offs_n, offs_d, stride_kb, stride_kt,
                                     stride_vb, stride_vt, PAGE, True, SLIDING, PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only padded rows can have l == 0; they are not stored
    out = acc / l_i[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} unsupported: need a power of two in [16, 256]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None)")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q ([T, H, d]) over each sequence's paged context; returns [T, H, d].

    Handles any mix of chunk lengths (q_len 1 decode rows included) and cached prefixes.
    """
    _check_inputs(q, k_cache, sliding_window)
    q = _last_dim_contiguous(q)
    k_cache, v_cache = _last_dim_contiguous(k_cache), _last_dim_contiguous(v_cache)
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    bt = meta.block_tables
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    grid = lambda META: (triton.cdiv(meta.max_query_len, META["BLOCK_M"]), num_heads, meta.num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, bt, meta.query_start_loc, meta.seq_lens,
        scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
        SLIDING=sliding_window is not None, PRECISION=precision)
    return out
