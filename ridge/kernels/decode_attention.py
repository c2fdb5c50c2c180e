"""Decode attention (one query token per sequence) over the paged KV cache: split-KV flash-decoding.

Decode is memory bound: every K/V byte of the context is read once per step, the FLOPs are tiny.
Three choices make the kernel stream at HBM speed:

* GQA packing. One program serves one kv head and *all* of its query heads: the group's G query
  rows form the M side of tl.dot (padded to >= 16 rows, the smallest tensor-core tile), so each
  K/V tile is loaded once for G heads instead of G times, and the dot runs on tensor cores
  instead of as scalar FMAs.
* Split-KV. batch * kv_heads programs alone cannot fill 132 SMs when the batch is small (B=1,
  8 kv heads = 8 programs). Each sequence's context is cut into num_splits ranges handled by
  independent programs, each writing a partial (normalised) output plus its log-sum-exp, merged
  with the usual rescale-by-exp(lse - max) rule.
* The merge runs inside the split kernel (one launch per layer, not two). After storing its
  partial, each split program takes a ticket from a per-(sequence, kv head) counter; the program
  that draws the last ticket merges all splits of that (sequence, kv head) and resets the
  counter to zero. At B=1 a decode step is ~40 us, so a second launch (its launch gap and its
  own short tail) was a measurable share of the step. The two-kernel form is kept behind
  `fused_merge=False` for the benchmark's comparison and the tests.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.prefill_attention import _LOG2E, _check_inputs, _last_dim_contiguous

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256   # below this the merge and the pipeline prologue cost more than they save
# The in-kernel merge streams the partials in [chunk of splits, group heads, head_dim] fp32 tiles of
# this many elements: 16 KiB, 32 registers per thread at 4 warps (two in flight: one being
# reduced, the next one loading).
_MERGE_TILE = 4096
# Register cap for the fused kernel (hd <= 128, one 16-row tensor-core tile of query heads). At
# <= 128 registers per thread 4 programs share an SM (4 x 128 threads x 128 = the 64K register
# file): at B=1 that is 528 program slots on 132 SMs for the 512 programs of 64 splits x 8 kv
# heads, one wave. Compiled offline for sm_90 by Triton 3.6's ptxas (2026-11-22), the two-kernel
# form's split kernel uses 88-126 registers; the fused one, left alone, 126-158 (150-158 at
# BLOCK_N 64, i.e. 3 programs per SM); capped at 128 it spills 0-36 bytes, with at most one
# spill instruction inside the main loop. None disables the cap (for an A/B on the GPU).
_FUSED_MAXNREG: int | None = 128


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # Deep pipelines (3-4 stages of cp.async) keep enough bytes in flight per SM to cover HBM
    # latency; 4 warps suffice because the per-tile math is a thin [16..64, N] x [N, d] GEMM.
    # On an H200 the autotuner picked BLOCK_N 64 with 4 warps and 2-3 stages at every benchmark
    # shape (2026-11-22, two-kernel merge); compile time per config (~1 s at first use, per
    # tuning bucket) is paid while capturing decode graphs, so the set stays small.
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 4))]


def _cap_fused_registers(configs, named_args, **kwargs):
    d = {**named_args, **kwargs}
    if not (d["FUSED"] and _FUSED_MAXNREG and d["HEAD_DIM"] <= 128 and d["BLOCK_H"] <= 16):
        return configs
    return [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=_FUSED_MAXNREG)
            for c in configs]


# The best pipeline depth and tile depend on how much each program streams and on how many
# programs share the SMs, so both (coarsely bucketed) are part of the key: without them the
# first shape's winner served every later shape (B=1, L=32k varied 52-147 us between runs).
# FUSED is in the key because the in-kernel merge is part of what the autotuner times.
@triton.autotune(configs=_configs(),
                 key=["HEAD_DIM", "BLOCK_H", "PAGE", "DIRECT", "FUSED", "work_bucket", "grid_bucket"],
                 prune_configs_by={"early_config_prune": _cap_fused_registers})
@triton.jit(do_not_specialize=["work_bucket", "grid_bucket"])  # key-only: no compiled variant per value
def _decode_split_kernel(Q, K, V, Out, O_part, Lse, Tickets, block_tables, query_start_loc, seq_lens,
                         qk_scale, window, num_splits, work_bucket, grid_bucket,
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, SLIDING: tl.constexpr, DIRECT: tl.constexpr,
                         FUSED: tl.constexpr, BLOCK_G: tl.constexpr,
                         MERGE_CHUNK: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc + seq)
    # Padding slot: no query this step. Every split of the row leaves here, before any ticket,
    # so a padding row never touches its counter.
    if tl.load(query_start_loc + seq + 1) == q_row:
        return
    ctx_len = tl.load(seq_lens + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx_len - window, 0)
    # Tiles stay aligned to BLOCK_N (a multiple of the page) so a tile covers whole pages.
    lo_tile = lo // BLOCK_N * BLOCK_N
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx_len - lo_tile, num_splits), BLOCK_N), 1) * BLOCK_N
    # Splits [0, n_live) hold keys; the rest are empty. Under CUDA graphs num_splits is fixed at
    # capture for max_model_len, so a short context leaves most splits empty: with the fused
    # merge they leave at once and take no ticket (every split of the row computes the same
    # n_live, so they agree on how many tickets there are). Split 0 always holds a key that the
    # window keeps (lo_tile <= lo < ctx_len and chunk >= BLOCK_N), so n_live >= 1.
    n_live = tl.maximum(tl.cdiv(ctx_len - lo_tile, chunk), 1)
    if FUSED:
        if split >= n_live:
            return
    start = lo_tile + split * chunk
    end = tl.minimum(start + chunk, ctx_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    h_ok = offs_h < GROUP
    q = tl.load(Q + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None], other=0.0)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    K_h = K + kv_head * stride_kh
    V_h = V + kv_head * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
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
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 domain
        qk = tl.where(k_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile may be fully masked
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_ptrs = Out + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DIRECT:  # a single split: no merge, write the final output
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=h_ok[:, None])
    else:
        # Empty split (start >= end, two-kernel form only): out = 0 and lse = -inf, so the merge
        # gives it zero weight.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        num_heads = tl.num_programs(1) * GROUP
        part = (seq * num_splits + split).to(tl.int64) * num_heads + heads  # [seq, split, head]
        if not FUSED:
            tl.store(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None])
            tl.store(Lse + part, lse, mask=h_ok)
        elif n_live == 1:
            # The whole context is in this split (a short sequence under a graph captured for
            # max_model_len): its normalised output is the answer, no ticket needed. Bit-identical
            # to merging it: its weight is exp2(0) = 1 and the others' are 0.
            tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=h_ok[:, None])
        else:
            tl.store(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None])
            tl.store(Lse + part, lse, mask=h_ok)
            # Memory ordering, as in CUDA's threadFenceReduction sample and cooperative groups'
            # grid sync (barrier, then one thread's fence + atomic):
            # 1. The partial stores above are spread over all threads of the CTA. The barrier
            #    orders every thread's stores before what thread 0 does next (CTA-scope
            #    synchronisation: bar.sync).
            # 2. A scalar tl.atomic_add is issued by one thread (Triton predicates it to thread 0
            #    and broadcasts the old value through shared memory behind another barrier).
            #    sem="acq_rel" at gpu scope makes it a release that is cumulative in the PTX
            #    memory model: everything ordered before it, including the other threads' stores
            #    through the barrier, is visible at gpu scope before the incremented count is.
            #    Without it, a plain atomic could become visible while the partials still sat in
            #    flight, and the last program would merge stale data.
            # 3. The same atomic is an acquire for the program that draws the last ticket: it
            #    read-modify-wrote a count that every other split's release produced (the counter's
            #    atomics form one release sequence), so all their partials happen-before its
            #    following reads. Those reads are issued by all threads after the broadcast
            #    barrier, and use .cg (cache at L2 only): L1 is per SM and not coherent, so a read
            #    through it could return a line cached before the other SMs wrote (L2 is the
            #    device's point of coherence).
            # The merge reads back this program's own partial from memory too (rather than from
            # registers), so whichever program happens to be last runs the same arithmetic on
            # the same bits: the result does not depend on arrival order.
            tl.debug_barrier()
            counter = Tickets + seq * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == n_live - 1:
                # Every live split has drawn its ticket, so nothing else touches this counter in
                # this launch; the next launch (the next layer, the next graph replay) is stream-
                # ordered after this kernel's completion and finds it zero.
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _merge_group(Out, O_part, Lse, q_row, seq, kv_head, num_heads, num_splits, n_live,
                             stride_ot, stride_oh, GROUP, BLOCK_G, HEAD_DIM, MERGE_CHUNK)


@triton.jit
def _load_chunk(O_part, Lse, row0, first, n_live, offs_c, heads, offs_d, g_ok, num_heads,
                HEAD_DIM: tl.constexpr):
    """Partials of splits [first, first + CHUNK) x the group's heads; splits >= n_live masked off."""
    s = first + offs_c
    ok = (s < n_live) & g_ok
    row = (row0 + s) * num_heads + heads
    lse = tl.load(Lse + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o = tl.load(O_part + row * HEAD_DIM + offs_d, mask=ok, other=0.0, cache_modifier=".cg")
    return lse, o


@triton.jit
def _merge_group(Out, O_part, Lse, q_row, seq, kv_head, num_heads, num_splits, n_live,
                 stride_ot, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                 HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Merge the n_live partials of each of the kv head's GROUP query heads into Out.

    This runs in one program while the rest of the GPU has finished, so its latency is the step's
    tail: GROUP x n_live x HEAD_DIM fp32 (128 KiB at 4 heads x 64 splits x 128) read back from L2.
    * The partials are laid out [seq, split, head, d], so one split's GROUP heads are one
      contiguous run and a [CHUNK splits, GROUP, HEAD_DIM] tile covers all the heads at once.
    * The loop keeps the accumulator as a whole tile and only multiplies and adds elementwise,
      so no thread waits on another inside it; the tile is reduced over its split rows once,
      after the loop. (A [splits, d] tile per head, reduced as it arrives, crosses warps through
      shared memory behind barriers once per head and per softmax statistic.)
    * The next chunk's loads are issued before the current chunk's arithmetic (their addresses
      depend only on the loop index), so two chunks are in flight; the loop runs over the live
      splits only.
    * Online log-sum-exp rescaling (as in the split kernel's own loop) keeps one pass: no separate
      pass over the lse values for their maximum.
    The order of every sum is fixed by the split index (row r of the tile accumulates splits r,
    r + CHUNK, ... in order; the rows are then combined by a fixed tree), never by which program
    arrived last: the result is bit-reproducible. Live splits are never empty, and masked lanes
    (splits >= n_live, padded heads) carry lse = -inf, weight 0.
    """
    offs_c = tl.arange(0, CHUNK)[:, None, None]
    offs_g = tl.arange(0, BLOCK_G)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    g_ok = offs_g < GROUP
    row0 = seq.to(tl.int64) * num_splits
    heads = kv_head * GROUP + offs_g
    m = tl.full([CHUNK, BLOCK_G, 1], float("-inf"), tl.float32)
    l = tl.zeros([CHUNK, BLOCK_G, 1], tl.float32)
    acc = tl.zeros([CHUNK, BLOCK_G, HEAD_DIM], tl.float32)
    lse_n, o_n = _load_chunk(O_part, Lse, row0, 0, n_live, offs_c, heads, offs_d, g_ok, num_heads, HEAD_DIM)
    for first in range(0, n_live, CHUNK):
        lse, o = lse_n, o_n
        lse_n, o_n = _load_chunk(O_part, Lse, row0, first + CHUNK, n_live, offs_c, heads, offs_d, g_ok,
                                 num_heads, HEAD_DIM)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse - m_use)
        l = l * alpha + w
        acc = acc * alpha + w * o
        m = m_new
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    scale = tl.math.exp2(m - m_all[None, :, :])
    num = tl.sum(acc * scale, 0)
    den = tl.sum(l * scale, 0)
    res = num / tl.where(den == 0.0, 1.0, den)
    g2 = tl.arange(0, BLOCK_G)[:, None]
    d2 = tl.arange(0, HEAD_DIM)[None, :]
    tl.store(Out + q_row.to(tl.int64) * stride_ot + (kv_head * GROUP + g2) * stride_oh + d2,
             res.to(Out.dtype.element_ty), mask=g2 < GROUP)


@triton.jit
def _merge_kernel(Out, O_part, Lse, query_start_loc, num_splits, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr):
    """The two-kernel form's merge (fused_merge=False): one program per (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc + seq)
    if tl.load(query_start_loc + seq + 1) == q_row:
        return
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    part = (seq * num_splits + offs_s).to(tl.int64) * tl.num_programs(1) + head  # [seq, split, head]
    lse = tl.load(Lse + part, mask=s_ok, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    o = tl.load(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty))


# ---------------------------------------------------------------------------- ticket counters
# One int32 counter per (sequence, kv head), zeroed once and left zero by every launch (the last
# program of each (sequence, kv head) resets its own). Owned here, per device, rather than passed
# in through `workspace`:
# * it must outlive a single call: every layer, every step and every CUDA-graph replay reuses it,
#   and a buffer allocated per call would need a zeroing memset per call, i.e. the extra launch
#   the fused merge removes;
# * a captured graph bakes in its address, so it is never freed: growing allocates a new buffer
#   and keeps the old one alive (graphs captured earlier keep using it, and keep it zero);
# * it must not be allocated inside a graph capture: torch.zeros there records the memset into
#   the graph (not run now) and takes the memory from the graph's private pool. The engine warms
#   up every bucket eagerly, largest first, before capturing (DecodeGraphs.capture), so the
#   buffer has reached its final size before any capture; growth during capture raises.
# Launches that share the buffer must be ordered on one stream (ridge runs decode on one stream
# per device; tensor parallelism is one process per GPU). A launch cannot stop half-way in normal
# operation: host-side failures (argument checks, compilation, autotuning) happen before the
# launch, and a device fault is sticky, taking the CUDA context and this buffer with it. So no
# counter is ever left non-zero between launches.
_TICKETS: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED_TICKETS: list[torch.Tensor] = []   # outgrown buffers that captured graphs may still use
_MIN_TICKETS = 4096                         # 16 KiB: B * kv_heads up to 512 x 8 without growing


def _device_key(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return device.type, device.index if device.index is not None else torch.cuda.current_device()
    return device.type, device.index if device.index is not None else -1


def _ticket_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's counter buffer, grown (outside graph capture) to at least n counters."""
    key = _device_key(device)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"decode_attention: the split-merge ticket counters ({0 if buf is None else buf.numel()}) "
                f"must grow to {n} during CUDA-graph capture; run the largest batch eagerly once "
                "before capturing (DecodeGraphs.capture does)")
        if buf is not None:
            _RETIRED_TICKETS.append(buf)
        buf = torch.zeros(max(_MIN_TICKETS, triton.next_power_of_2(n)), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


def _merge_chunk(block_g: int, head_dim: int) -> int:
    return max(1, _MERGE_TILE // (block_g * head_dim))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the SMs, but no split shorter than 256 keys.

    Measured on an H200 (benchmarks/attention.py --splits-sweep, two-kernel merge, 2026-11-21/22):
    once batch x kv heads alone covers the SMs, ~2 programs per SM is best (B=32, L=4k: 2 splits
    reach 90% of copy bandwidth, 3 only 71%; B=128, L=2k: 1 split 93%); below that, more
    splits pay (B=1, L=32k as CUDA-graph replays: 32 splits 0.70, 64 splits 0.81, 128 0.75).

    B=1 with the fused merge: the merge removes a cost that did not depend on the split count
    (the second launch) and concentrates one that does (all GROUP heads' GROUP x splits x d
    partials are read by one program per kv head instead of by one program per query head), so
    it gives no reason to go above 64 and may favour fewer; `--splits-sweep` on the benchmark
    times both forms at 32-128 splits. 64 (~4 programs per SM) stays until that sweep says
    otherwise.
    """
    if device.type != "cuda" or _INTERPRET:
        return max(1, min(3, triton.cdiv(max_seq_len, 32)))  # small and odd: exercises the merge
    sms = _device_sms(device)
    target = (2 if batch * num_kv_heads >= sms else 4) * sms
    splits = triton.cdiv(target, max(1, batch * num_kv_heads))
    return max(1, min(splits, _MAX_SPLITS, max_seq_len // _MIN_KEYS_PER_SPLIT))


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
                     fused_merge: bool = True) -> torch.Tensor:
    """Attention of one query token per sequence (q [B, H, d], meta.max_query_len <= 1).

    `workspace` = (o_part float32 with >= B*H*num_splits*d elements, lse float32 with >=
    B*H*num_splits elements) lets a caller (e.g. a CUDA graph) preallocate the split buffers.
    `fused_merge=False` merges the splits with a second kernel launch (the older form, kept for
    the benchmark's comparison); the default merges inside the split kernel (see the ticket
    counters above).
    """
    if meta.max_query_len > 1:
        raise ValueError("decode_attention needs max_query_len <= 1; use prefill_attention")
    _check_inputs(q, k_cache, sliding_window)
    q = _last_dim_contiguous(q)
    k_cache, v_cache = _last_dim_contiguous(k_cache), _last_dim_contiguous(v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = meta.num_seqs
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0 or batch == 0:
        return out
    seq_span = min(meta.max_seq_len, sliding_window) if sliding_window else meta.max_seq_len
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, seq_span, q.device)
    n_part = batch * num_heads * num_splits
    fused = fused_merge and num_splits > 1
    if num_splits == 1:
        o_part = lse = out  # unused placeholders
    elif workspace is not None:
        o_part, lse = workspace[0].view(-1)[: n_part * head_dim], workspace[1].view(-1)[:n_part]
    else:
        o_part = torch.empty(n_part * head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_part, dtype=torch.float32, device=q.device)
    # The counters are only touched by the fused merge; seq_lens (int32 too) stands in otherwise.
    tickets = _ticket_counters(q.device, batch * num_kv_heads) if fused else meta.seq_lens
    block_g = triton.next_power_of_2(group)
    bt = meta.block_tables
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, o_part, lse, tickets, bt, meta.query_start_loc, meta.seq_lens,
        scale * _LOG2E, sliding_window or 0, num_splits,
        *_tuning_buckets(triton.cdiv(seq_span, num_splits), batch * num_kv_heads * num_splits, q.device),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        SLIDING=sliding_window is not None, DIRECT=num_splits == 1, FUSED=fused,
        BLOCK_G=block_g, MERGE_CHUNK=_merge_chunk(block_g, head_dim) if fused else 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if num_splits > 1 and not fused:
        _merge_kernel[(batch, num_heads)](
            out, o_part, lse, meta.query_start_loc, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4)
    return out
