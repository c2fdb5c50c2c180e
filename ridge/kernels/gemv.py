"""GEMV / skinny GEMM for decode (Triton): y = act(x) @ W^T (+ b) for M <= 8 rows of x.

The reference is `gemv_ref` below: F.linear, after silu_and_mul_ref (ridge/kernels/silu_mul.py)
when act="silu_mul".

Why a kernel of our own. A decode step at batch 1-8 does ~2 FLOPs per weight element read: each
projection is a stream of its weight matrix from HBM, and the figures of merit are the fraction
of copy bandwidth that stream reaches and the number of launches. At M <= 8 cuBLAS (F.linear)
picks split-K kernels for the square-ish projections, which stay well short of copy bandwidth
(BENCHMARKS.md), and on o_proj and down_proj it launches two kernels (split-K partials + a
reduce); each kernel boundary inside a CUDA graph is a drain and a launch with HBM idle, a
sizeable fraction of a whole o_proj weight stream.

Design - one launch, no split-K, no atomics, no zeroed buffer:

  * The grid runs over N in blocks of BLOCK_N rows of W; each program owns BLOCK_N outputs for
    all M rows and walks the whole K dimension, so its result is final and written once. W rows
    are contiguous along K (nn.Linear layout): a [BLOCK_N, BLOCK_K] tile is BLOCK_N coalesced
    row segments, 16-byte vector loads, every byte of every sector used. The weight is read once
    per step and is far larger than L2, so its loads are marked evict_first (it should not push
    out the small, reused activations). Triton 3.6 keeps that hint on direct loads (num_stages
    1) and drops it when it lowers a pipelined load to cp.async (seen in the sm_90 PTX).
  * BLOCK_N is small (8-64 rows): without split-K the only parallelism is N / BLOCK_N, and a
    4096-row projection must still give each of the 132 SMs at least two programs.
  * Latency hiding: HBM latency under load is ~600-800 ns, so streaming ~4.5 TB/s needs ~3 MB of
    loads in flight, ~25 KB per SM. A tile is BLOCK_N * BLOCK_K * 2 B (8-16 KB in bf16); the
    software pipeline (num_stages, via tl.range) issues the loads of the next num_stages - 1
    tiles (cp.async into shared memory) before it consumes the current one, and 2-4 co-resident
    programs per SM multiply that. That - not the arithmetic - is what the tile sizes are for.
  * The M rows of x: the [BLOCK_M, BLOCK_K] x tile (BLOCK_M = next power of 2 >= M; padded rows
    are masked, never fetched) is tiny and L2-resident - every program rereads it. Two ways to
    combine it with the W tile, chosen by the config's `dot` flag:
      - dot=False (FMA): an fp32 [BLOCK_M, BLOCK_N, BLOCK_K] accumulator of elementwise products,
        reduced over K once after the loop, so the loop body is loads and FMAs with no cross-lane
        shuffles. Its registers grow with BLOCK_M: the M = 1 path (the classic GEMV).
      - dot=True (tensor cores): tl.dot(W_tile, x_tile^T), W in the MMA's 16-row slot ("swap
        AB", as CUTLASS does for skinny GEMMs) and the M rows in its 8-wide slot, which Triton
        pads. The K reduction happens inside the MMA, so M = 8 costs no more registers or
        shuffles than M = 2; the padding wastes MMA throughput a bandwidth-bound kernel has
        plenty of. One warp per 16 rows of W: the x operand cannot be split between warps, so
        more warps would each compute (and read from shared memory) the same MMA tile.
  * act="silu_mul": x is the merged gate/up output [M, 2K]; each program computes
    silu(gate) * up for its K tile on the fly (fp32 math, rounded to x's dtype after the silu and
    after the product: silu_and_mul's rounding points), so the down projection needs no separate
    activation kernel and no [M, K] round trip. Every program recomputes it for all K: the
    [M, 2K] input is L2-resident and M * BLOCK_K exps per tile are cheap against the W tile.

No runtime autotuning: compile time is paid during CUDA-graph capture, which must stay short.
`gemv_config` is a heuristic (to be set from `benchmarks/gemv.py --sweep` data); `config=`
overrides it. K is a compile-time constant (a model has a few distinct in_features, each
compiled once). Accumulation is fp32; the output has x's dtype. CUDA-graph capturable.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.rounding import emulate_rne, round_to
from ridge.kernels.silu_mul import silu_and_mul_ref, silu_times
from ridge.kernels.tiles import sm_count

GEMV_MAX_ROWS = 8          # decode CUDA-graph buckets 1, 2, 4, 8; larger batches go to cuBLAS
ACTS = (None, "silu_mul")


class GemvConfig(NamedTuple):
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) and the inner-product path."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot: bool              # tensor-core tl.dot instead of the FMA accumulator (module docstring)


@triton.jit
def _x_tile(X, offs_m, m_mask, k, K, stride_xm, stride_xk,
            SILU_MUL: tl.constexpr, MASK_K: tl.constexpr, LAYOUT_BARRIER: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of act(x) in x's dtype; padded rows / columns are 0."""
    rows = X + offs_m[:, None] * stride_xm
    if MASK_K:
        mask = m_mask[:, None] & (k < K)[None, :]
    else:
        mask = m_mask[:, None]
    if SILU_MUL:
        g = tl.load(rows + k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(rows + (k[None, :] + K) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        # silu_mul.py's arithmetic, the product rounded once below: the unfused path's rounding
        # points exactly
        h = silu_times(g, u, X.dtype.element_ty, EMULATE_RNE)
        if LAYOUT_BARRIER:
            # max(h, h) == h exactly, but a reduction is where Triton stops propagating the dot
            # operand's layout backwards. Without it the silu is evaluated in the MMA operand
            # layout, where every lane of every warp holds (and recomputes) whole columns of the
            # tile: 32x redundant exps/divisions and 255 registers at M = 1. With it, each
            # element is computed once in a compact layout and moved to the MMA layout through
            # shared memory (compile-checked for sm_90: 115-170 registers, no spills).
            h = tl.max(tl.join(h, h), axis=2)
        return round_to(h, X.dtype.element_ty, EMULATE_RNE)
    else:
        return tl.load(rows + k[None, :] * stride_xk, mask=mask, other=0.0)


@triton.jit
def _load_w(w_rows, k, K, MASK_K: tl.constexpr):
    if MASK_K:
        w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
    return w


@triton.jit
def _accumulate(acc, w, X, offs_m, m_mask, k, K, stride_xm, stride_xk,
                SILU_MUL: tl.constexpr, MASK_K: tl.constexpr, USE_DOT: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """acc += act(x)[:, k] * w, w being the [BLOCK_N, BLOCK_K] tile of W at columns k."""
    xt = _x_tile(X, offs_m, m_mask, k, K, stride_xm, stride_xk, SILU_MUL, MASK_K, USE_DOT, EMULATE_RNE)
    if USE_DOT:
        # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M] -> [BLOCK_N, BLOCK_M]; "ieee" keeps fp32
        # inputs out of TF32 (as F.linear by default); 16-bit products are exact in fp32 anyway
        if EMULATE_RNE:
            # CPU tensors, i.e. the interpreter only: its dot would multiply raw bf16 bit patterns
            # as integers. A 16-bit product is exact in fp32, so upcasting gives the same sums.
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
    else:
        acc += w.to(tl.float32)[None, :, :] * xt.to(tl.float32)[:, None, :]
    return acc


@triton.jit
def _gemv_kernel(X, W, Bias, Y, M, N, K: tl.constexpr, stride_xm, stride_xk, stride_wn, stride_ym, stride_yn,
                 SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr, PDL: tl.constexpr):
    # K is a compile-time constant: the trip count is known to the software pipeliner, and a model
    # has only a few distinct in_features (4096 and 14336 for Llama-3-8B), each compiled once,
    # before CUDA-graph capture. (It also sidesteps the Triton 3.6 interpreter, which cannot
    # loop to a runtime scalar bound under NumPy 2.)
    K_FULL: tl.constexpr = (K // BLOCK_K) * BLOCK_K
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    # the last block's rows past N reread row N - 1 instead of being masked: the W loads stay
    # unpredicated full-width vectors; those rows are simply not stored
    w_rows = W + tl.minimum(offs_n, N - 1)[:, None] * stride_wn
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # With PDL (ridge/kernels/pdl.py) the first W tile is loaded before waiting for the previous
    # kernel: the weights are never written during a step, so that load overlaps the previous
    # kernel's tail instead of starting the weight stream from idle. With K < BLOCK_K the first
    # tile is the masked tail.
    FIRST_MASKED: tl.constexpr = K_FULL == 0
    if PDL:
        w_first = _load_w(w_rows, offs_k, K, FIRST_MASKED)
    pdl_wait(PDL)
    if PDL:
        acc = _accumulate(acc, w_first, X, offs_m, m_mask, offs_k, K, stride_xm, stride_xk,
                          SILU_MUL, FIRST_MASKED, USE_DOT, EMULATE_RNE)
    K_START: tl.constexpr = BLOCK_K if PDL else 0
    # full tiles, no K mask. tl.range's num_stages pipelines the W and x loads (cp.async into
    # shared memory) on both paths; the launch option alone would leave the FMA path unpipelined
    for k0 in tl.range(K_START, K_FULL, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        acc = _accumulate(acc, _load_w(w_rows, k, K, False), X, offs_m, m_mask, k, K, stride_xm, stride_xk,
                          SILU_MUL, False, USE_DOT, EMULATE_RNE)
    if K_FULL < K and (K_FULL > 0 or not PDL):   # one masked tail tile (unless it was the first)
        k = K_FULL + offs_k
        acc = _accumulate(acc, _load_w(w_rows, k, K, True), X, offs_m, m_mask, k, K, stride_xm, stride_xk,
                          SILU_MUL, True, USE_DOT, EMULATE_RNE)
    n_mask = offs_n < N
    if USE_DOT:   # acc is y^T: [BLOCK_N, BLOCK_M]
        y = acc
        if HAS_BIAS:
            y += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None] * stride_yn
        mask = m_mask[None, :] & n_mask[:, None]
    else:
        y = tl.sum(acc, axis=2)   # [BLOCK_M, BLOCK_N]: the one cross-lane reduction, after the loop
        if HAS_BIAS:
            y += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        mask = m_mask[:, None] & n_mask[None, :]
    tl.store(ptrs, round_to(y, Y.dtype.element_ty, EMULATE_RNE), mask=mask)


def gemv_config(M: int, N: int, K: int, num_sms: int = 132) -> GemvConfig:
    """Launch configuration from the shape (no autotuning; see the module docstring).

    M = 1: the FMA path. BLOCK_N x BLOCK_K = 8192 elements, so the deferred fp32 accumulator is
    64 registers per thread at 4 warps; BLOCK_K up to 512 (1 KB of each bf16 row per tile, eight
    16-byte loads per thread at BLOCK_N = 16); 3 stages: two tiles in flight per program.
    M >= 2: tensor cores. One warp per 16 rows of W: an MMA tile is 16 rows tall and the padded
    x operand cannot be split between warps, so more warps than BLOCK_N / 16 would all compute
    (and read from shared memory) the same tile. BLOCK_K 256, 4 stages: 3 x 8 KB in flight per
    16 rows, a few programs per SM within shared memory.
    Both: BLOCK_N is the largest that still gives every SM two programs (no split-K: the grid
    is the only parallelism), so small projections use narrow blocks.
    These are first values from bytes-in-flight arithmetic, compile-checked for sm_90 (registers,
    no spills, shared memory) and timed as they are (BENCHMARKS.md); `benchmarks/gemv.py --sweep`
    is what should set them.
    """
    if triton.knobs.runtime.interpret:   # CPU interpreter: tiny tiles, so CI stays fast and the K tail is exercised
        return GemvConfig(16, 32, 1, 1, M > 1)
    dot = M > 1
    widths = (64, 32, 16) if dot else (32, 16, 8)
    block_n = next((bn for bn in widths if triton.cdiv(N, bn) >= 2 * num_sms), widths[-1])
    if dot:
        return GemvConfig(block_n, min(256, max(16, triton.next_power_of_2(K))), block_n // 16, 4, True)
    return GemvConfig(block_n, min(512, 8192 // block_n, max(16, triton.next_power_of_2(K))), 4, 3, False)


def _as_config(config, M: int, N: int, K: int, device: torch.device) -> GemvConfig:
    if config is None:
        return gemv_config(M, N, K, sm_count(device))
    config = tuple(config)
    if len(config) == 4:   # (BLOCK_N, BLOCK_K, num_warps, num_stages): the path follows M
        config = (*config, M > 1)
    cfg = GemvConfig(*config)
    for name in ("block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"gemv: config {name} must be a power of 2, got {v}")
    if cfg.dot and (cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"gemv: the dot path needs block_n and block_k >= 16, got {cfg}")
    return cfg


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         act: str | None = None, out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """y = act(x) @ weight^T (+ bias), [M, N], x's dtype, fp32 accumulation.

    x: [M, K] (any strides), or [M, 2K] = [gate | up] with act="silu_mul"; M <= GEMV_MAX_ROWS.
    weight: [N, K], rows contiguous (nn.Linear layout). bias: [N] or None. out: [M, N] or None.
    config: a GemvConfig or (BLOCK_N, BLOCK_K, num_warps, num_stages[, dot]); default gemv_config.
    """
    if act not in ACTS:
        raise ValueError(f"gemv: act must be one of {ACTS}, got {act!r}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"gemv: x has {M} rows, more than GEMV_MAX_ROWS = {GEMV_MAX_ROWS} "
                         "(larger batches are compute-shaped: use F.linear)")
    k_in = 2 * K if act == "silu_mul" else K
    if x.shape[1] != k_in:
        what = f"2 * in_features = {k_in} ([gate | up])" if act == "silu_mul" else f"in_features = {K}"
        raise ValueError(f"gemv: x has {x.shape[1]} columns, weight {tuple(weight.shape)} needs {what}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"gemv: x and weight must share one of bf16/fp16/fp32, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: weight rows must be contiguous (stride 1 along in_features)")
    if x.device != weight.device:
        raise ValueError(f"gemv: x on {x.device}, weight on {weight.device}")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise ValueError(f"gemv: bias must have shape ({N},) on {x.device}, got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"gemv: out must be [{M}, {N}] {x.dtype} on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros_like(out))
    cfg = _as_config(config, M, N, K, x.device)
    block_m = triton.next_power_of_2(M)
    pdl = use_pdl(x)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), out.stride(0), out.stride(1),
        SILU_MUL=act == "silu_mul", HAS_BIAS=bias is not None, USE_DOT=cfg.dot,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        EMULATE_RNE=emulate_rne(x), PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl))
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             act: str | None = None) -> torch.Tensor:
    """The function gemv computes, in torch: the unfused silu_and_mul, then F.linear."""
    if act not in ACTS:
        raise ValueError(f"gemv_ref: act must be one of {ACTS}, got {act!r}")
    if act == "silu_mul":
        x = silu_and_mul_ref(x)
    return torch.nn.functional.linear(x, weight, bias)
