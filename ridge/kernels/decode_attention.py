"""Decode attention (one query token per sequence, or a verify step's few) over the paged KV cache:
split-KV flash-decoding.

Decode is memory bound: every K/V byte of the context is read once per step, the FLOPs are tiny.
Two choices make the kernel stream at HBM speed:

* GQA packing. One program serves one kv head and *all* of its query heads: the group's G query
  rows form the M side of tl.dot (padded to >= 16 rows, the smallest tensor-core tile), so each
  K/V tile is loaded once for G heads instead of G times, and the dot runs on tensor cores
  instead of as scalar FMAs.
* Split-KV. batch * kv_heads programs alone cannot fill 132 SMs when the batch is small (B=1,
  8 kv heads = 8 programs). Each sequence's context is cut into num_splits ranges handled by
  independent programs, each writing a partial (normalised) output plus its log-sum-exp; a
  small second kernel merges the splits with the usual rescale-by-exp(lse - max) rule.

With an FP8 cache (ridge/kernels/kv_fp8.py) each K/V tile is read as e4m3 plus one scale byte
per key, head_dim + 1 bytes per row instead of 2 * head_dim: the step's dominant traffic halves,
so the per-tile instruction count, not HBM, becomes the limit unless it is kept close to bf16's:
* The e4m3 tiles are converted exactly to q's dtype and the dots are the bf16 path's. A key's
  scale is a power of two, so it commutes with the dot: (q . k8) * 2^e == q . (k8 * 2^e) and
  (p * 2^e) . v8 == p . (v8 * 2^e), bit for bit away from the ends of the float range (rounding
  commutes with a power of two).
  The scales therefore multiply the [G, BLOCK_N] scores and probabilities, not the [BLOCK_N, d]
  tiles: d / BLOCK_H times fewer multiplies (the same numbers as kv_fp8.dequantize_tile).
* V is the B operand of p @ v, which wants each register to hold two consecutive *keys*: for
  bf16 ldmatrix.trans transposes 16-bit pairs on the way out of shared memory, but Hopper has no
  8-bit transposing load, so letting Triton convert after that read costs one 1-byte shared load
  per element. _e4m3_rows converts in the layout the tile was loaded in (an opaque inline-asm
  op Triton cannot move past the layout change), and the bf16 tile then takes the bf16 route.
* The scale bytes are 1-byte gathers (a key's bytes for all kv heads are adjacent), too narrow
  for cp.async, so the software pipeline would leave them synchronous; they are loaded one tile
  ahead instead, their latency hidden behind the current tile's math.
FP8 is a constexpr: the bf16 kernel compiles without a trace of it.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.kv_fp8 import KVScales, check_kv_scales
from ridge.kernels.kv_fp8 import scale_from_bytes
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.prefill_attention import _LOG2E, _check_inputs, _last_dim_contiguous
from ridge.kernels.tiles import sm_count

_INTERPRET = triton.knobs.runtime.interpret
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256   # below this the merge and the pipeline prologue cost more than they save
MAX_QUERIES = 8             # queries a sequence (a verify step's k + 1) the decode kernel takes
_MAX_ROWS = 128             # packed rows (queries x group heads) a program


def fits_decode(max_query_len: int, group: int) -> bool:
    """Whether the decode kernel takes a batch of at most max_query_len queries a sequence."""
    return max_query_len <= MAX_QUERIES and max(1, max_query_len) * group <= _MAX_ROWS


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # Deep pipelines (3-4 stages of cp.async) keep enough bytes in flight per SM to cover HBM
    # latency; 4 warps suffice because the per-tile math is a thin [16..64, N] x [N, d] GEMM.
    # The set is the autotuner's measured picks and their neighbours (BENCHMARKS.md): compile
    # time per config is paid per tuning bucket while capturing decode graphs, so it stays small.
    # FP8 adds two 128-key tiles (the same bytes in flight as a bf16 64-key tile); see _prune.
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 4), (128, 4, 3), (128, 4, 4))]


def _prune(configs, named_args, **kwargs):
    """The 128-key tiles are for the FP8 cache only: the bf16 kernel tunes over its measured set."""
    fp8 = {**named_args, **kwargs}["FP8"]
    return [c for c in configs if fp8 or c.kwargs["BLOCK_N"] < 128]


def _bench_briefly(fn, quantiles):
    """A config's time for the autotuner: a call streams for tens to hundreds of microseconds, so
    20 ms of repetitions (after 5 of warm-up) give its median from a hundred runs or more; Triton's
    default 25 + 100 ms a config made tuning every key at start-up cost most of a minute."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def _e4m3_rows(x, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """An e4m3 tile -> DTYPE (exact), converted in the register layout it was loaded in.

    As inline asm that claims side effects, the conversion cannot be moved past the layout change
    into the tensor-core operand (see the module docstring). Four e4m3 bytes per call: the
    hardware converts pairs to f16 (cvt e4m3x2); bf16 goes on through f32 (exact). ASM is off in
    the interpreter, which cannot run PTX, and for float32 q.
    """
    if ASM and DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, a0, a1, a2, a3; .reg .b32 h0, h1; .reg .f32 f0, f1, f2, f3;"
            " mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 h0, lo; cvt.rn.f16x2.e4m3x2 h1, hi;"
            " mov.b32 {a0, a1}, h0; mov.b32 {a2, a3}, h1;"
            " cvt.f32.f16 f0, a0; cvt.f32.f16 f1, a1; cvt.f32.f16 f2, a2; cvt.f32.f16 f3, a3;"
            " cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=False, pack=4)
    elif ASM and DTYPE == tl.float16:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2;"
            " cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return x.to(DTYPE)


@triton.jit
def _tile_scales(K_scale, V_scale, bt_row, k_idx, end, stride_ksb, stride_kst, stride_vsb, stride_vst,
                 PAGE: tl.constexpr):
    """The K and V scales (float32 powers of two) of one kv head's keys k_idx; 0 past `end`."""
    k_ok = k_idx < end
    page = tl.load(bt_row + k_idx // PAGE, mask=k_ok, other=0).to(tl.int64)
    row = (k_idx % PAGE).to(tl.int64)
    ks = tl.load(K_scale + page * stride_ksb + row * stride_kst, mask=k_ok, other=0)
    vs = tl.load(V_scale + page * stride_vsb + row * stride_vst, mask=k_ok, other=0)
    return scale_from_bytes(ks), scale_from_bytes(vs)


# The best pipeline depth and tile depend on how much each program streams and on how many
# programs share the SMs, so both (coarsely bucketed) are part of the key: without them the
# first shape's winner served every later shape, and long-context decode varied from run to run.
# The two bucket arguments are read by the autotuner only, so they are not specialised: Triton
# would otherwise compile a variant per value class (== 1, divisible by 16) of each, multiplying
# the compiles that decode-graph capture pays. The picks are kept in Triton's cache beside the
# compiled kernels (cache_results), so a warm start replays them instead of timing every config.
@triton.autotune(configs=_configs(), key=["HEAD_DIM", "BLOCK_H", "QUERIES", "PAGE", "DIRECT", "FP8", "work_bucket", "grid_bucket"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=True, do_bench=_bench_briefly)
@triton.jit(do_not_specialize=["work_bucket", "grid_bucket"])
def _decode_split_kernel(Q, K, V, K_scale, V_scale, Out, O_part, Lse, page_tables, query_start_loc,
                         seq_lens, qk_scale, window, num_splits, work_bucket, grid_bucket,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                         stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                         GROUP: tl.constexpr, QUERIES: tl.constexpr, BLOCK_H: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SLIDING: tl.constexpr, DIRECT: tl.constexpr,
                         FP8: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # q and the new token's K/V come from the kernels just before: wait for them before anything
    # else, and before the padding rows' early return (ridge/kernels/pdl.py)
    pdl_wait(PDL)
    q_row = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_row
    if q_len == 0:  # padding slot: no query this step
        return
    ctx_len = tl.load(seq_lens + seq)
    lo = 0
    if SLIDING:   # the first query's window: the later ones' start after it (masked per row below)
        lo = tl.maximum(ctx_len - q_len + 1 - window, 0)
    # Tiles stay aligned to BLOCK_N (a multiple of the page) so a tile covers whole pages.
    lo_tile = lo // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(ctx_len - lo_tile, num_splits), BLOCK_N) * BLOCK_N
    start = lo_tile + split * chunk
    end = tl.minimum(start + chunk, ctx_len)

    # packed rows: query i of the sequence's QUERIES x head g of the group, row i * GROUP + g
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_h // GROUP
    heads = kv_head * GROUP + offs_h % GROUP
    h_ok = (offs_h < QUERIES * GROUP) & (qi < q_len)
    rows = (q_row + qi).to(tl.int64)
    q_pos = ctx_len - q_len + qi                     # each query sees the keys up to its own position
    q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None], other=0.0)
    bt_row = page_tables + seq.to(tl.int64) * stride_bt
    K_h = K + kv_head * stride_kh
    V_h = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    if FP8:
        Ks_h = K_scale + kv_head * stride_ksh
        Vs_h = V_scale + kv_head * stride_vsh
        k_next, v_next = _tile_scales(Ks_h, Vs_h, bt_row, start + offs_n, end, stride_ksb, stride_kst,
                                      stride_vsb, stride_vst, PAGE)
    for start_n in range(start, end, BLOCK_N):
        k_idx = start_n + offs_n
        k_ok = k_idx < end
        if SLIDING:
            k_ok = k_ok & (k_idx >= lo)
        page = tl.load(bt_row + k_idx // PAGE, mask=k_ok, other=0).to(tl.int64)
        row = (k_idx % PAGE).to(tl.int64)
        k = tl.load(K_h + page[:, None] * stride_kb + row[:, None] * stride_kt + offs_d[None, :],
                    mask=k_ok[:, None], other=0.0)
        v = tl.load(V_h + page[:, None] * stride_vb + row[:, None] * stride_vt + offs_d[None, :],
                    mask=k_ok[:, None], other=0.0)
        if FP8:  # this tile's scales were fetched last iteration; fetch the next tile's
            k_sc, v_sc = k_next, v_next
            k_next, v_next = _tile_scales(Ks_h, Vs_h, bt_row, k_idx + BLOCK_N, end, stride_ksb, stride_kst,
                                          stride_vsb, stride_vst, PAGE)
            k = k.to(Q.dtype.element_ty)
            v = _e4m3_rows(v, Q.dtype.element_ty, ASM)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 domain
        if FP8:
            qk = qk * k_sc[None, :]
        if QUERIES > 1:
            ok = k_ok[None, :] & (k_idx[None, :] <= q_pos[:, None])
            if SLIDING:
                ok = ok & (k_idx[None, :] > q_pos[:, None] - window)
            qk = tl.where(ok, qk, float("-inf"))
        else:
            qk = tl.where(k_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile may be fully masked
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * v_sc[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if DIRECT:  # a single split: no merge pass, write the final output
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=h_ok[:, None])
    else:
        # Empty split (start >= end): out = 0 and lse = -inf, so the merge gives it zero weight.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part = (rows * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None])
        tl.store(Lse + part, lse, mask=h_ok)


@triton.jit
def _merge_kernel(Out, O_part, Lse, query_start_loc, num_splits, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    qi = tl.program_id(2)                            # the sequence's query (0 in decode)
    pdl_wait(PDL)
    q_row = tl.load(query_start_loc + seq)
    if tl.load(query_start_loc + seq + 1) - q_row <= qi:
        return
    row = (q_row + qi).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    part = (row * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(Lse + part, mask=s_ok, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))  # the split holding the row's own position is never empty
    o = tl.load(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def _device_sms(device: torch.device) -> int:
    return sm_count(device)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the SMs, but no split shorter than 256 keys.

    Each split is a program that streams its share of the pages; the merge and the pipeline
    prologue are its overhead. Once batch x kv heads alone covers the SMs, ~2 programs per SM
    is best; below that, more splits pay (benchmarks/attention.py --splits-sweep; the figures
    are in BENCHMARKS.md).
    """
    if device.type != "cuda" or _INTERPRET:
        return max(1, min(3, triton.cdiv(max_seq_len, 32)))  # small and odd: exercises the merge
    sms = _device_sms(device)
    target = (2 if batch * num_kv_heads >= sms else 4) * sms
    splits = triton.cdiv(target, max(1, batch * num_kv_heads))
    return max(1, min(splits, _MAX_SPLITS, max_seq_len // _MIN_KEYS_PER_SPLIT))


def query_rows(queries: int, group: int) -> tuple[int, int]:
    """(QUERIES, BLOCK_H) of a launch for up to `queries` queries a sequence: the packed-row tile
    holds queries x group rows, rounded up to a power of two (16 at least), and QUERIES, the most
    queries a sequence the kernel takes, is all that tile holds (up to MAX_QUERIES): each sequence's
    own count masks its rows, so batches of 2 to 8 queries a sequence share a tile's compiled
    variant and tuning key instead of one each."""
    block_h = max(16, triton.next_power_of_2(queries * group))
    return (1 if queries == 1 else min(MAX_QUERIES, block_h // group)), block_h


def launch_key(batch: int, num_kv_heads: int, group: int, seq_span: int, queries: int, device: torch.device,
               num_splits: int | None = None) -> tuple[int, int, int, int, int]:
    """(splits, QUERIES, BLOCK_H, work bucket, grid bucket) of a call: with one split or more
    (DIRECT), what the autotuner keys on besides the model's fixed shape (ridge/kernels/decode_tuning.py)."""
    splits = num_splits or choose_num_splits(batch, num_kv_heads, seq_span, device)
    return (splits, *query_rows(queries, group),
            *_tuning_buckets(triton.cdiv(seq_span, splits), batch * num_kv_heads * splits, device))


def _tuning_buckets(keys_per_program: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(keys each program streams: <=256, <=1k, <=4k, more) x (programs: < SMs, < 4x SMs, more)."""
    work = min(3, max(0, (max(keys_per_program, 1) - 1).bit_length() - 8 + 1) // 2)
    if device.type != "cuda" or _INTERPRET:
        return work, 0
    sms = _device_sms(device)
    return work, 0 if programs < sms else (1 if programs < 4 * sms else 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                     out: torch.Tensor | None = None, num_splits: int | None = None,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                     kv_scales: KVScales | None = None) -> torch.Tensor:
    """Attention of one query token per sequence (q [B, H, d], meta.max_query_len <= 1), or of a
    few (a speculative verify step's k + 1: up to MAX_QUERIES, each sequence's queries the last
    positions of its context, causal among themselves): a sequence's queries and its group's heads
    are the packed rows of one program (QUERIES x GROUP <= 128), so its K/V is still read once.
    An FP8 cache needs kv_scales = (k_scale, v_scale) (attention_ref.py's layout).

    `workspace` = (o_part float32 with >= T*H*num_splits*d elements, lse float32 with >=
    T*H*num_splits elements, T the query rows) lets a caller (e.g. a CUDA graph) preallocate the split buffers.
    """
    _check_inputs(q, k_cache, sliding_window)
    scales = check_kv_scales(k_cache, v_cache, kv_scales)
    q = _last_dim_contiguous(q)
    k_cache, v_cache = _last_dim_contiguous(k_cache), _last_dim_contiguous(v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch, queries = meta.num_seqs, max(1, meta.max_query_len)
    if not fits_decode(meta.max_query_len, group):
        raise ValueError(f"decode_attention takes up to {MAX_QUERIES} queries a sequence and {_MAX_ROWS} packed rows "
                         f"(queries x {group} heads a kv head), got max_query_len {meta.max_query_len}: "
                         "use prefill_attention")
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0 or batch == 0:
        return out
    seq_span = min(meta.max_seq_len, sliding_window) if sliding_window else meta.max_seq_len
    num_splits, query_key, block_h, work, grid = launch_key(batch, num_kv_heads, group, seq_span, queries, q.device,
                                                            num_splits)
    n_part = q.shape[0] * num_heads * num_splits
    if num_splits == 1:
        o_part = lse = out  # unused placeholders
    elif workspace is not None:
        o_part, lse = workspace[0].view(-1)[: n_part * head_dim], workspace[1].view(-1)[:n_part]
    else:
        o_part = torch.empty(n_part * head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_part, dtype=torch.float32, device=q.device)
    bt = meta.page_tables
    pdl = use_pdl(q)
    ks, vs = scales if scales is not None else (k_cache, v_cache)  # placeholders, never read
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, ks, vs, out, o_part, lse, bt, meta.query_start_loc, meta.seq_lens,
        scale * _LOG2E, sliding_window or 0, num_splits, work, grid,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        *ks.stride()[:3], *vs.stride()[:3],
        GROUP=group, QUERIES=query_key, BLOCK_H=block_h, HEAD_DIM=head_dim,
        PAGE=page,
        SLIDING=sliding_window is not None, DIRECT=num_splits == 1, FP8=scales is not None,
        ASM=not _INTERPRET and q.dtype != torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl, **launch_options(pdl))
    if num_splits > 1:
        _merge_kernel[(batch, num_heads, queries)](
            out, o_part, lse, meta.query_start_loc, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(num_splits), PDL=pdl, num_warps=4,
            **launch_options(pdl))
    return out
