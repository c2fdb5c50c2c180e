"""The experts of a mixture-of-experts layer (Triton): for each token t and each of its top_k
experts e (weight r), y_t = sum_e r * W2[e] (silu(W1[e] x_t) * W3[e] x_t). The reference is
`fused_moe_ref` below: a loop over experts, as HF transformers runs them.

Weights: w13 [E, 2I, H] (each expert's gate rows then its up rows, as the dense merged gate/up
projection) and w2 [E, H, I], rows contiguous along K: the nn.Linear layout, read in coalesced
row segments.

Two paths, chosen by the number of tokens (`SMALL_MAX_TOKENS`):

  * Small batches (decode): the work is a stream of the selected experts' weights, ~2 FLOPs per
    weight element read, as in the dense GEMV (ridge/kernels/gemv.py, whose design this follows:
    one launch per projection, no split-K, BLOCK_N small so that the grid fills the GPU, an fp32
    [BLOCK_N, BLOCK_K] FMA accumulator reduced once after the K loop). Padding each expert's
    rows to 16 for tl.dot, as a grouped GEMM must, would cost nothing in bandwidth, but a grid
    sized for the worst case of T * top_k experts x 16-row tiles is mostly programs that exit,
    and the layout needs an alignment pass first; vLLM's fused kernel loses to a dense GEMV of
    the same bytes at small batch for these reasons. Here gate/up runs one program per (pair,
    N tile) with SiLU-and-mul in its epilogue; down runs one program per (token, N tile) that
    loads the tiles of all the token's top_k experts at once (H / BLOCK_N programs are too few to
    keep enough bytes in flight one expert at a time), applies the routing weights and sums the
    experts in registers: the top-k sum is fused and its order fixed (batch-invariant). A token's experts
    are distinct, so at batch 1 every selected expert's weights stream exactly once; at a few
    tokens an expert two tokens share is read twice, the second time mostly from L2.
  * Larger batches: a grouped GEMM over the pairs aligned by expert (ridge/kernels/moe_route.py):
    each BLOCK_M-row tile belongs to one expert and takes its weight tiles once; tl.dot on tensor
    cores; tiles in grouped raster order (ridge/kernels/tiles.py) so that neighbouring programs
    share an expert's weight tiles in L2. Tiles past the last used one exit at once, so the
    grid can be sized for the worst case and captured in a CUDA graph. gate/up computes the gate
    and the up tile of the same columns in two accumulators and writes silu(gate) * up; down
    multiplies each row by its routing weight and fuses the top-k sum. A token's top_k rows lie
    in top_k different experts' tiles, so different programs; adding them with float atomics
    would make the order - and so the rounding - change with the batch. Instead each program
    writes its weighted rows to the pairs' own rows of a [T * top_k, H] scratch and counts them
    in a per-(token, N tile) counter (an acq_rel atomic after a CTA barrier: the classic
    last-block reduction); the program that brings a token's count to top_k reads the token's
    top_k rows back (its own from registers) and sums them in slot order in fp32. The sum is the
    same whatever the batch and whichever program arrives last, and no launch follows; but its
    reads sit in the GEMM's epilogue, where their latency is exposed, and at thousands of tokens
    the scratch outgrows L2: a torch sum after the kernel (`fuse_sum=False`, the same bytes in one
    streaming pass) is then faster, so the plan (ridge/layers/moe_tuning.py) measures both.

Quantized experts (ridge/kernels/moe_quant.py: FP8 blocks, INT4 groups) are read through one
'load a dequantized weight tile' entry, the format a constexpr: the same kernels, weight-only;
INT4 takes the nibble-plane kernels instead (ridge/kernels/moe_int4.py: the small path's, and the
grouped GEMM's K loop for tiles one group wide), where its instructions, not its bytes, bound it.

Rounding follows the reference's points in the activation dtype (the GEMM outputs, silu, the
product, each expert's output, the routed product); accumulation is fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ridge.kernels.moe_quant import (FP8_BLOCK, Fp8Experts, Int4Experts, check_tiles, dequantize_experts,  # noqa: F401
                                     INT4, INT4_GROUP, expert_tables, load_weight_tile, small_down_program,
                                     small_gate_up_program, tiles_fit)
from ridge.kernels.moe_int4 import grouped_int4_planes, planes_asm, small_int4
from ridge.kernels.moe_route import align_by_expert
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.rounding import emulate_rne, round_to
from ridge.kernels.silu_mul import silu_mul_sums
from ridge.kernels.tiles import grouped_tile

SMALL_MAX_TOKENS = 16
# the fused top-k sum reads the value a tensor atomic returns, which older Tritons (before 3.5)
# gave only to one of the threads that hold a replicated element
FUSED_SUM_OK = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 5)


class SmallTiles(NamedTuple):
    """The small-batch kernels' tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class GroupedTiles(NamedTuple):
    """The grouped GEMM's tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DEFAULT_SMALL = SmallTiles(16, 128, 4, 3)
DEFAULT_GROUPED = GroupedTiles(64, 64, 64, 4, 3)
def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor) -> torch.Tensor:
    """x [T, H], routing weights/experts [T, top_k] -> [T, H]: per expert, its rows' gated MLP
    (outputs rounded to x's dtype as nn.Linear's are), times the routing weight, summed over a
    token's experts in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    w13, w2 = dequantize_experts(w13), dequantize_experts(w2)
    inter = w13.shape[1] // 2
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        gate, up = F.linear(x[token], w13[e]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, (y * weights[token, slot, None].to(y.dtype)).float())
    return out.to(x.dtype)


@triton.jit
def _dot(a, b, acc, EMULATE_RNE: tl.constexpr):
    if EMULATE_RNE or a.dtype == tl.float32:
        # fp32 models stay out of TF32 (as F.linear by default). CPU tensors, i.e. the interpreter:
        # its 16-bit dot multiplies raw bit patterns as integers; 16-bit products are exact in
        # fp32, so upcasting gives the same sums
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _small_gate_up_kernel(X, W, WS, WZ, Experts, Out, inter, K: tl.constexpr, TOP_K: tl.constexpr, stride_xt, stride_we,
                          stride_wn, stride_se, stride_sn, stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr, PDL: tl.constexpr,
                          FMT: tl.constexpr):
    pair, offs_n, n_mask, e = small_gate_up_program(Experts, inter, BLOCK_N, PDL)
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = W + e * stride_we + offs_n[:, None] * stride_wn
    w_up = w_gate + inter * stride_wn
    s_e, z_e = WS + e * stride_se, WZ + e * stride_se
    x_row = X + (pair // TOP_K) * stride_xt + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # K is a compile-time constant (a model has one H and one I): tl.range's num_stages then
    # pipelines the weight loads (cp.async), which the FMA loop would otherwise wait on one by one
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k
        x = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        m = n_mask[:, None] & k_mask[None, :]
        wg = load_weight_tile(w_gate, s_e, z_e, offs_n[:, None], offs_k[None, :], k, m, n_mask[:, None], stride_sn,
                              X.dtype.element_ty, EMULATE_RNE, FMT, "evict_first")
        wu = load_weight_tile(w_up, s_e, z_e, offs_n[:, None] + inter, offs_k[None, :], k, m, n_mask[:, None],
                              stride_sn, X.dtype.element_ty, EMULATE_RNE, FMT, "evict_first")
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
    y = silu_mul_sums(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), Out.dtype.element_ty, EMULATE_RNE)
    tl.store(Out + pair * stride_ot + offs_n, y, mask=n_mask)


@triton.jit
def _small_down_kernel(Hid, W, WS, WZ, Experts, RouteW, Out, N, K: tl.constexpr, TOP_K: tl.constexpr, stride_hp, stride_we,
                       stride_wn, stride_se, stride_sn, stride_ot, BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr, PDL: tl.constexpr,
                       FMT: tl.constexpr):
    t, offs_n, n_mask, js, j_mask, e = small_down_program(Experts, N, TOP_K, BLOCK_TK, BLOCK_N, PDL)
    offs_k = tl.arange(0, BLOCK_K)
    # all top_k experts' tiles in one [TOP_K, BLOCK_N, BLOCK_K] load: top_k times the bytes in
    # flight per program that one expert at a time would have (H / BLOCK_N programs are few)
    w_rows = W + e[:, None, None] * stride_we + offs_n[None, :, None] * stride_wn
    row_mask = j_mask[:, None, None] & n_mask[None, :, None]
    h_rows = Hid + (t * TOP_K + js)[:, None] * stride_hp + offs_k[None, :]
    acc = tl.zeros([BLOCK_TK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k
        h = tl.load(h_rows + k, mask=j_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        m = row_mask & k_mask[None, None, :]
        w = load_weight_tile(w_rows, WS + e[:, None, None] * stride_se, WZ + e[:, None, None] * stride_se,
                             offs_n[None, :, None], offs_k[None, None, :], k, m, row_mask, stride_sn,
                             Hid.dtype.element_ty, EMULATE_RNE, FMT, "evict_first")
        acc += w.to(tl.float32) * h[:, None, :]
    y = round_to(tl.sum(acc, axis=2), Out.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    r = round_to(tl.load(RouteW + t * TOP_K + js, mask=j_mask, other=0.0), Out.dtype.element_ty, EMULATE_RNE)
    routed = round_to(y * r.to(tl.float32)[:, None], Out.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    total = tl.sum(routed, axis=0)
    tl.store(Out + t * stride_ot + offs_n, round_to(total, Out.dtype.element_ty, EMULATE_RNE), mask=n_mask)


# the pair and block counts change with every batch: specialized (== 1, divisible by 16) they would
# compile the kernel again the first time a count lands on each case, mid-serving
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _grouped_kernel(X, W, WS, WZ, Out, PairOrder, BlockExpert, RouteW, Scratch, Arrived, num_pairs, N, K, x_rows_per_pair,
                    num_blocks, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    GATED: tl.constexpr, TOP_K: tl.constexpr, FUSE_SUM: tl.constexpr, EMULATE_RNE: tl.constexpr,
                    PDL: tl.constexpr, FMT: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_blocks * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pdl_wait(PDL)       # the layout is the alignment kernel's, x the previous layer's
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e >= 0:
        pair = tl.load(PairOrder + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PLANES:      # INT4, one group a K step: the nibble-plane loop (ridge/kernels/moe_int4.py)
            acc, acc_u = grouped_int4_planes(X, pair // x_rows_per_pair, valid, stride_xm, W, WS, WZ, e, offs_n, n_mask,
                                             N, K, stride_we, stride_wn, stride_se, stride_sn, acc, acc_u, GATED, ASM,
                                             EMULATE_RNE)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            x_ptrs = X + (pair // x_rows_per_pair)[:, None] * stride_xm + offs_k[None, :]
            w_rows = W + e * stride_we + offs_n[None, :] * stride_wn
            s_e, z_e = WS + e * stride_se, WZ + e * stride_se
            for k in range(0, K, BLOCK_K):
                k_mask = offs_k < K - k
                a = tl.load(x_ptrs + k, mask=valid[:, None] & k_mask[None, :], other=0.0)
                w_mask = k_mask[:, None] & n_mask[None, :]
                w = load_weight_tile(w_rows, s_e, z_e, offs_n[None, :], offs_k[:, None], k, w_mask, n_mask[None, :],
                                     stride_sn, X.dtype.element_ty, EMULATE_RNE, FMT, "")
                acc = _dot(a, w, acc, EMULATE_RNE)
                if GATED:
                    w_up = load_weight_tile(w_rows + N * stride_wn, s_e, z_e, offs_n[None, :] + N, offs_k[:, None], k,
                                            w_mask, n_mask[None, :], stride_sn, X.dtype.element_ty, EMULATE_RNE, FMT,
                                            "")
                    acc_u = _dot(a, w_up, acc_u, EMULATE_RNE)
        mask = valid[:, None] & n_mask[None, :]
        if TOP_K > 0:
            r = round_to(tl.load(RouteW + pair, mask=valid, other=0.0), Out.dtype.element_ty, EMULATE_RNE)
            y = round_to(acc, Out.dtype.element_ty, EMULATE_RNE).to(tl.float32) * r.to(tl.float32)[:, None]
            y = round_to(y, Out.dtype.element_ty, EMULATE_RNE)
            rows = Scratch + offs_n[None, :]                    # the scratch is [pairs, N], contiguous
            tl.store(rows + pair[:, None] * N, y, mask=mask)
            if FUSE_SUM:
                tl.debug_barrier()                              # every thread's rows stored before the count
                token, slot = pair // TOP_K, pair % TOP_K
                arrived = tl.atomic_add(Arrived + token * tl.cdiv(N, BLOCK_N) + pid_n, 1, mask=valid,
                                        sem="acq_rel", scope="gpu")
                last = valid & (arrived == TOP_K - 1)
                tl.debug_barrier()                              # ... and the count seen before any thread reads
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(TOP_K):                # slot order: the same sum in any batch
                    theirs = last & (slot != j)                 # this program's own row is still in registers
                    part = tl.load(rows + (token * TOP_K + j)[:, None] * N, mask=theirs[:, None] & n_mask[None, :],
                                   other=0.0, cache_modifier=".cg")
                    total += tl.where((slot == j)[:, None], y.to(tl.float32), part.to(tl.float32))
                tl.store(Out + token[:, None] * stride_om + offs_n[None, :], round_to(total, Out.dtype.element_ty,
                         EMULATE_RNE), mask=last[:, None] & n_mask[None, :])
        else:
            if GATED:
                y = silu_mul_sums(acc, acc_u, Out.dtype.element_ty, EMULATE_RNE)
            else:
                y = round_to(acc, Out.dtype.element_ty, EMULATE_RNE)
            tl.store(Out + pair[:, None] * stride_om + offs_n[None, :], y, mask=mask)


def _check(x, w13, w2, weights, experts):
    E, two_i, H = w13.shape
    if x.dim() != 2 or x.shape[1] != H or w2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"(x [T, H], w13 [E, 2I, H], w2 [E, H, I])")
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: routing weights {tuple(weights.shape)} and experts {tuple(experts.shape)} "
                         f"must both be [T={x.shape[0]}, top_k]")
    for name, t in (("x", x), ("w13", expert_tables(w13)[0]), ("w2", expert_tables(w2)[0])):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe: {name} must be contiguous along its last dim")


def fused_moe_small(x, w13, w2, weights, experts, tiles: tuple[SmallTiles, SmallTiles] = (DEFAULT_SMALL,) * 2):
    """The small-batch path (module docstring); tiles: (gate/up's, down's)."""
    _check(x, w13, w2, weights, experts)
    (T, H), two_i, top_k = x.shape, w13.shape[1], experts.shape[1]
    inter = two_i // 2
    hidden = torch.empty(T * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    if T == 0:
        return out
    pdl, rne = use_pdl(x), emulate_rne(x)
    gu, dn = tiles
    experts, weights = experts.contiguous(), weights.contiguous()
    block_tk, dn_k = triton.next_power_of_2(top_k), small_down_block_k(dn, top_k)
    check_tiles(w13, gu.block_k, dn_k)
    if expert_tables(w13)[3] == INT4:       # the nibble-plane kernels (ridge/kernels/moe_int4.py)
        return small_int4(x, hidden, out, w13, w2, weights, experts, gu, dn, dn_k, pdl, rne, launch_options(pdl))
    (w13, s13, z13, fmt), (w2, s2, z2, _) = expert_tables(w13), expert_tables(w2)
    _small_gate_up_kernel[(T * top_k, triton.cdiv(inter, gu.block_n))](
        x, w13, s13, z13, experts, hidden, inter, H, top_k, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), hidden.stride(0), BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, NUM_STAGES=gu.num_stages,
        EMULATE_RNE=rne, PDL=pdl, FMT=fmt, num_warps=gu.num_warps, **launch_options(pdl))
    _small_down_kernel[(T, triton.cdiv(H, dn.block_n))](
        hidden, w2, s2, z2, experts, weights, out, H, inter, top_k, hidden.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0), s2.stride(1), out.stride(0), BLOCK_TK=block_tk, BLOCK_N=dn.block_n, BLOCK_K=dn_k,
        NUM_STAGES=dn.num_stages, EMULATE_RNE=rne, PDL=pdl, FMT=fmt, num_warps=dn.num_warps, **launch_options(pdl))
    return out


def small_down_block_k(tiles: SmallTiles, top_k: int) -> int:
    """The small down kernel's K tile: it loads all top_k experts' tiles at once, so they share block_k."""
    return max(16, tiles.block_k // triton.next_power_of_2(top_k))


def grouped_gemm(x, w, layout, num_pairs: int, x_rows_per_pair: int, tiles: GroupedTiles, gated: bool = False,
                 route_weights: torch.Tensor | None = None, fuse_sum: bool = True) -> torch.Tensor:
    """Rows of x (one per token: x_rows_per_pair = top_k; or one per pair: 1) times their pair's
    expert's weight w [E, N(x2 if gated), K], aligned by `layout` (align_by_expert at tiles.block_m)
    -> [num_pairs, N] in pair order, silu(gate) * up if gated; or, given the routing weights
    [T, top_k] (x one row per pair), each row times its weight and summed over the token's
    top_k -> [T, N], in the kernel (fuse_sum) or by a torch sum after it."""
    pair_order, block_expert, _ = layout
    check_tiles(w, tiles.block_k)
    n, K = (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
    w, ws, wz, fmt = expert_tables(w)
    nb = block_expert.numel()
    n_tiles = triton.cdiv(n, tiles.block_n)
    top_k = 0 if route_weights is None else route_weights.shape[1]
    fuse_sum = fuse_sum and top_k > 0 and FUSED_SUM_OK
    if top_k:
        scratch = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
        out = torch.empty(num_pairs // top_k, n, dtype=x.dtype, device=x.device) if fuse_sum else scratch
        arrived = torch.zeros(num_pairs // top_k, n_tiles, dtype=torch.int32, device=x.device) if fuse_sum else out
        route_weights = route_weights.contiguous()
    else:
        out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
        scratch = arrived = route_weights = out
    pdl = use_pdl(x)
    _grouped_kernel[(nb * n_tiles,)](
        x, w, ws, wz, out, pair_order, block_expert, route_weights, scratch, arrived, num_pairs, n, K,
        x_rows_per_pair, nb, x.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=8, GATED=gated, TOP_K=top_k,
        FUSE_SUM=fuse_sum, EMULATE_RNE=emulate_rne(x), PDL=pdl, FMT=fmt,
        PLANES=fmt == INT4 and tiles.block_k == INT4_GROUP, ASM=planes_asm(x), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **launch_options(pdl))
    if top_k and not fuse_sum:
        return scratch.view(-1, top_k, n).sum(dim=1)
    return out


def fused_moe_grouped(x, w13, w2, weights, experts, tiles: tuple[GroupedTiles, GroupedTiles] = (DEFAULT_GROUPED,) * 2,
                      fuse_sum: bool = True):
    """The grouped path (module docstring); tiles: (gate/up's, down's), which must share block_m;
    fuse_sum: the top-k sum in the down GEMM (else a torch sum after it)."""
    _check(x, w13, w2, weights, experts)
    gu, dn = tiles
    if gu.block_m != dn.block_m:
        raise ValueError(f"fused_moe: gate/up and down tiles share the aligned layout, so block_m; got "
                         f"{gu.block_m} and {dn.block_m}")
    T, top_k = experts.shape
    layout = align_by_expert(experts.contiguous(), w13.shape[0], gu.block_m)
    P = T * top_k
    hidden = grouped_gemm(x, w13, layout, P, top_k, gu, gated=True)
    return grouped_gemm(hidden, w2, layout, P, 1, dn, route_weights=weights, fuse_sum=fuse_sum)

