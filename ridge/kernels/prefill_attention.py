"""Prefill / chunked-prefill attention over the paged KV cache (FlashAttention-2 style, Triton).

One program owns a BLOCK_M tile of one sequence's query rows for one query head. The Q tile stays
in registers; K/V tiles of BLOCK_N keys stream through shared memory; softmax is computed online
(running max m, running sum l) so the [M, N] score tile never leaves the chip, and the result is
divided by l once at the end.

A chunk's context has two parts, read two ways:
  * the cached prefix (prefix-cache hits, earlier chunks): gathered row by row through the block
    table (a key row is head_dim contiguous elements, so each row is one wide coalesced load even
    though consecutive keys may sit on different physical pages);
  * the chunk's own keys: read from the contiguous [T, kvh, d] K/V projections through tensor
    descriptors. On Hopper a descriptor load is one TMA instruction: the copy engine moves the
    whole tile into shared memory with no per-element address arithmetic in registers, and
    rows past the sequence end come back as zeros (no mask needed). A plain prefill is all of
    this second kind, which is where the time goes.
Prefix tiles are always fully visible (only a sliding window or the last partial tile masks
them). For the chunk's own keys, tiles entirely left of the diagonal run in a mask-free loop,
the tiles straddling it in a second, masked loop, and tiles right of it are never visited.

An FP8 cache (ridge/kernels/kv_fp8.py) changes only the first kind: the gathered e4m3 rows and
their scale bytes are dequantized in registers to q's dtype (FP8 is a constexpr, so the bf16
kernel is unchanged). The chunk's own k, v arrive already dequantized from the KV-write kernel,
so the TMA path reads them as before.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.kv_fp8 import KVScales, check_kv_scales
from ridge.kernels.kv_fp8 import dequantize_tile

_INTERPRET = triton.knobs.runtime.interpret
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
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # Hopper: BLOCK_M=128 gives the wgmma units a full 64-row instruction per warpgroup (8 warps =
    # 2 warpgroups); BLOCK_N 64/128 amortises the softmax bookkeeping per tile; 2-3 stages of
    # TMA prefetch hide HBM latency behind the two tensor-core GEMMs of the previous tile.
    # A wider sweep (BLOCK_M/N in {64, 128}, 4/8 warps, 2-4 stages) picked 64x64, 4 warps, 3 stages
    # at every prefill length it timed (BENCHMARKS.md); each config costs a compile at first use,
    # so only the winner and its neighbours stay.
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2))]


def _prune(configs, named_args, **kwargs):
    d = {**named_args, **kwargs}["HEAD_DIM"]
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        acc_regs = bm * d // (32 * c.num_warps)                 # fp32 accumulator regs per thread
        smem = 2 * (bm * d + c.num_stages * 2 * bn * d)         # bf16 Q + K/V tiles in flight
        # 8 warps = 2 warpgroups only pay off with a 128-row tile (wgmma is 64 rows per group).
        useful = (bm == 128) == (c.num_warps == 8)
        if acc_regs <= 128 and smem <= 220 * 1024 and useful:
            keep.append(c)
    return keep or configs[:1]


@triton.jit
def _softmax_step(acc, l_i, m_i, q, k, v, qk_scale, key_pos, q_pos, key_end, window,
                  CAUSAL: tl.constexpr, LIMIT: tl.constexpr, SLIDING: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Fold one K/V tile into the running (acc, l, m). Scores carry scale*log2(e), so the
    softmax uses exp2, a single MUFU.EX2 op."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    return _softmax_fold(acc, l_i, m_i, qk, v, qk_scale, key_pos, q_pos, key_end, window, CAUSAL, LIMIT, SLIDING,
                         PRECISION)


@triton.jit
def _softmax_fold(acc, l_i, m_i, qk, v, qk_scale, key_pos, q_pos, key_end, window,
                  CAUSAL: tl.constexpr, LIMIT: tl.constexpr, SLIDING: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Fold one tile's raw scores qk [M, N] and its values v [N, dv] into (acc, l, m). Masks are
    compile-time: the mask-free tiles (most of them) pay for no compare/select at all."""
    if CAUSAL or LIMIT or SLIDING:
        ok = tl.full(qk.shape, 1, tl.int1)
        if CAUSAL:
            ok = ok & (key_pos[None, :] <= q_pos[:, None])
        if LIMIT:
            ok = ok & (key_pos[None, :] < key_end)
        if SLIDING:
            ok = ok & (key_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(ok, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SLIDING:  # a row may have seen no visible key yet: keep exp2 away from (-inf) - (-inf)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        # scale folded into the max and the exponent: one FMA per score instead of a mul and a sub
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _gather_pages(K, V, K_s, V_s, bt_row, key_pos, offs_d, stride_kb, stride_kt, stride_vb, stride_vt,
                  stride_ksb, stride_kst, stride_vsb, stride_vst, key_end, PAGE: tl.constexpr,
                  LIMIT: tl.constexpr, FP8: tl.constexpr, DTYPE: tl.constexpr):
    """K/V rows of cached keys `key_pos`: key k lives at row k % PAGE of page bt[k // PAGE].
    With FP8, K_s/V_s are the scale bytes of the same rows (same page and row index, one byte
    per row), and the rows come back dequantized to DTYPE."""
    if LIMIT:
        k_ok = key_pos < key_end
        page = tl.load(bt_row + key_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + key_pos // PAGE).to(tl.int64)
    row = (key_pos % PAGE).to(tl.int64)
    k_ptrs = K + page[:, None] * stride_kb + row[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = V + page[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :]
    ks_ptrs = K_s + page * stride_ksb + row * stride_kst
    vs_ptrs = V_s + page * stride_vsb + row * stride_vst
    if LIMIT:
        k = tl.load(k_ptrs, mask=k_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8:
            k = dequantize_tile(k, tl.load(ks_ptrs, mask=k_ok, other=0), DTYPE)
            v = dequantize_tile(v, tl.load(vs_ptrs, mask=k_ok, other=0), DTYPE)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
        if FP8:
            k = dequantize_tile(k, tl.load(ks_ptrs), DTYPE)
            v = dequantize_tile(v, tl.load(vs_ptrs), DTYPE)
    return k, v


@triton.jit
def _head_rows(base, first_row, head_offset, stride_t, num_rows, BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """One head's rows [first_row, first_row + num_rows) of a [T, heads, HEAD_DIM] tensor as a
    [num_rows, HEAD_DIM] descriptor loading BLOCK rows at a time."""
    return tl.make_tensor_descriptor(base + first_row.to(tl.int64) * stride_t + head_offset,
                                     shape=[num_rows, HEAD_DIM], strides=[stride_t, 1],
                                     block_shape=[BLOCK, HEAD_DIM])


# cache_results: a warm start reads the pick from Triton's cache instead of timing the configs again
@triton.autotune(configs=_configs(), key=["HEAD_DIM", "PAGE", "SLIDING", "FP8"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=True)
@triton.jit
def _prefill_kernel(Q, K_new, V_new, K, V, K_scale, V_scale, Out, page_tables, query_start_loc,
                    seq_lens, qk_scale, window,
                    stride_qt, stride_qh, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                    stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    SLIDING: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
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
    prefix = tl.load(seq_lens + seq) - q_len
    kv_head = head // GROUP  # GQA / MQA

    # This sequence's rows of Q / O / new K / new V as [q_len, HEAD_DIM] descriptors: tiles past
    # q_len load as zeros and are dropped on store.
    q_desc = _head_rows(Q, q_start, head * stride_qh, stride_qt, q_len, BLOCK_M, HEAD_DIM)
    o_desc = _head_rows(Out, q_start, head * stride_oh, stride_ot, q_len, BLOCK_M, HEAD_DIM)
    k_desc = _head_rows(K_new, q_start, kv_head * stride_nkh, stride_nkt, q_len, BLOCK_N, HEAD_DIM)
    v_desc = _head_rows(V_new, q_start, kv_head * stride_nvh, stride_nvt, q_len, BLOCK_N, HEAD_DIM)

    first_q = m_block * BLOCK_M                      # local row index of the tile's first query
    offs_m = first_q + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = q_desc.load([first_q, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # 1. The cached prefix, positions [0, prefix): visible to every row (causally).
    q_pos = prefix + offs_m
    bt_row = page_tables + seq.to(tl.int64) * stride_bt
    K_h = K + kv_head * stride_kh
    V_h = V + kv_head * stride_vh
    Ks_h = K_scale + kv_head * stride_ksh
    Vs_h = V_scale + kv_head * stride_vsh
    lo = 0
    if SLIDING:  # tiles entirely left of every row's window are skipped
        lo = tl.maximum(prefix + first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    full_end = prefix // BLOCK_N * BLOCK_N
    for start_n in range(lo, full_end, BLOCK_N):
        key_pos = start_n + offs_n
        k, v = _gather_pages(K_h, V_h, Ks_h, Vs_h, bt_row, key_pos, offs_d, stride_kb, stride_kt,
                             stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                             prefix, PAGE, False, FP8, Q.dtype.element_ty)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale, key_pos, q_pos, prefix,
                                      window, False, False, SLIDING, PRECISION)
    if full_end < prefix and full_end >= lo:  # the prefix's last, partial tile
        key_pos = full_end + offs_n
        k, v = _gather_pages(K_h, V_h, Ks_h, Vs_h, bt_row, key_pos, offs_d, stride_kb, stride_kt,
                             stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                             prefix, PAGE, True, FP8, Q.dtype.element_ty)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale, key_pos, q_pos, prefix,
                                      window, False, True, SLIDING, PRECISION)

    # 2. The chunk's own keys, in local coordinates (key j, row i: visible if j <= i).
    lo = 0
    if SLIDING:
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    diag_start = (first_q + 1) // BLOCK_N * BLOCK_N  # keys below it are visible to every row
    for start_n in range(lo, diag_start, BLOCK_N):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale, start_n + offs_n, offs_m,
                                      q_len, window, False, False, SLIDING, PRECISION)
    diag_end = tl.minimum(first_q + BLOCK_M, q_len)
    for start_n in range(diag_start, diag_end, BLOCK_N):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, k, v, qk_scale, start_n + offs_n, offs_m,
                                      q_len, window, True, False, SLIDING, PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only padded rows can have l == 0; they are not stored
    o_desc.store([first_q, 0], (acc / l_i[:, None]).to(Out.dtype.element_ty))


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} unsupported: need a power of two in [16, 256]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None)")


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """A tensor descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but
    the last (which must be 1). The engine's q/k/v views of the QKV GEMM output already are;
    anything else is copied once rather than read wrongly."""
    b = t.element_size()
    ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
          and all(s * b % 16 == 0 for s in t.stride()[:-1]))
    return t if ok else t.contiguous()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory where each program writes the tensor descriptors it builds (128 B each)."""
    device = "cpu" if _INTERPRET else "cuda"
    return torch.empty(size, dtype=torch.int8, device=device)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      sliding_window: int | None = None, out: torch.Tensor | None = None,
                      kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal attention of q ([T, H, d]) over each sequence's context; returns [T, H, d].

    k, v ([T, kvh, d]) are the batch's new keys/values (also already written to the cache); the
    positions before them come from the cache pages. Handles any mix of chunk lengths (q_len 1
    decode rows included) and cached prefixes. An FP8 cache needs kv_scales = (k_scale, v_scale)
    (attention_ref.py's layout); k, v are then the dequantized values the cache holds, in q's dtype.
    """
    _check_inputs(q, k_cache, sliding_window)
    scales = check_kv_scales(k_cache, v_cache, kv_scales)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"new k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)} "
                         f"and cache {tuple(k_cache.shape)}")
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    k_cache, v_cache = _last_dim_contiguous(k_cache), _last_dim_contiguous(v_cache)
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    result = out if out is not None else torch.empty_like(q)
    out = _tma_ready(result)
    if num_tokens == 0 or meta.num_seqs == 0:
        return result
    bt = meta.page_tables
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    # The allocator lives in a context variable: set it on every call, from whatever thread runs.
    triton.set_allocator(_descriptor_scratch)
    grid = lambda META: (triton.cdiv(meta.max_query_len, META["BLOCK_M"]), num_heads, meta.num_seqs)
    ks, vs = scales if scales is not None else (k_cache, v_cache)  # placeholders, never read
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, ks, vs, out, bt, meta.query_start_loc, meta.seq_lens,
        scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        *ks.stride()[:3], *vs.stride()[:3],
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
        SLIDING=sliding_window is not None, FP8=scales is not None, PRECISION=precision)
    if out is not result:
        result.copy_(out)
    return result
