"""W4A16 skinny GEMM for decode (M <= 32 rows): y = x @ dequantize(qweight, scales, zeros), Triton.

ridge's INT4 layout and the reference are in ridge/kernels/int4_matmul.py (the entry point that
dispatches here). At decode sizes the kernel is a weight stream: 0.5 byte per weight plus
4 / group_size of scale and zero, read once from HBM. What it must get right is the work per
weight between the load and the multiply, because that, not the HBM, is what limits a naive
dequantizing kernel on Hopper: streaming ~4 TB/s of INT4 is ~30 weights per clock per SM, and an
SM issues 128 thread-instructions per clock, so ~4 instructions per weight is the whole budget.

Design (per program: BLOCK_M rows of x, BLOCK_N output columns, one K range):

  * Tensor cores even at M = 1. The alternative, fp32 FMAs, costs at least extract + convert + FMA
    per weight (3-5 instructions/weight compiled for sm_90); with mma.sync the multiply-add leaves
    the issue slots and x is padded to the MMA's 16 rows for free (the kernel is bound by bytes).
  * No shared-memory round trip for the weights. Ridge's layout packs 8 consecutive K values of a
    column in one int32, so nibble j of every word of a [BLOCK_K / 8, BLOCK_N] tile is the
    [BLOCK_K / 8, BLOCK_N] weight plane of the K indices 8i + j. The kernel multiplies plane j by
    the matching x plane x[:, 8i + j] (eight tl.dots per tile, the K order permuted, which a sum
    does not notice). Each plane is an elementwise function of the loaded word tile, so Triton
    reads the tile from its cp.async buffer straight into the MMA operand registers and dequantizes
    there (checked in the sm_90 TTGIR: local_load -> dot_op layout, no local_alloc of weights).
  * Two weights per instruction. On the GPU a plane is one short PTX sequence per pair of words:
    prmt gathers the two words' low (or high) 16-bit halves into one register, shr moves nibble j
    to bits 0-3 and 16-19, lop3 masks it and ORs in 0x4300 (bf16 128.0; 0x6400, fp16 1024.0 for fp16
    activations): two 16-bit floats 128 + q, exact, already packed as the MMA wants them. One
    packed subtraction of (128 + zero) gives q - z exactly (|q - z| <= 16). ~2.6 instructions per
    weight in the compiled loop, against ~4.3 for the same planes in plain Triton ops (fp32 magic
    numbers, an FADD per weight). Under TRITON_INTERPRET the same values come from plain ops.
  * Scales after the MMA, exactly: with group_size >= BLOCK_K a tile lies in one group, so the
    eight dots accumulate sum x (q - z) in fp32 and the tile adds that times the group's scale.
    Only group_size < BLOCK_K (32, 64) scales each weight before the dot ((q - z) * s rounded once
    to the activation dtype, per-row scale tiles).
    A group_size that does not divide K leaves a short last group: its table row is read by the
    last tile, which is the K tail (masked on the true K: x past K loads 0, packed rows past K / 8
    are not read), so the weights and x need no padding in memory.
  * Coalescing: a tile row is BLOCK_N contiguous int32 (512 B at 128 columns), 16-byte cp.async
    per thread, 4 pipeline stages; scales and zeros are one row of BLOCK_N per tile. One warp per
    64 columns (168 registers, no spills at BLOCK_N 128 / 2 warps for sm_90).
  * Split-K for SM fill: n-blocks x m-blocks programs alone cannot fill 132 SMs for o/down (32
    blocks) or k/v-sized outputs (8). K is cut into SPLIT_K ranges of whole tiles. Partials are
    reduced in the same launch (a second kernel costs a launch gap and a drain on a 3-10 us
    kernel): each program stores its fp32 [BLOCK_M, BLOCK_N] partial, takes a ticket (atomic add,
    acq_rel, GPU scope, after a CTA barrier), and the program that draws the last ticket sums all
    partials in split order (deterministic: the same bits whoever arrives last) from L2, writes
    y and resets its counter for the next launch. The partials are M x N x SPLIT_K fp32, small
    next to the weights (the heuristic caps them at 1/4 of the weight bytes); no memset, no
    second launch. Counters live in a per-device int32 table zeroed once. (fp32 atomic adds
    would need a zeroed fp32 buffer, a conversion pass, and would sum in arrival order: greedy
    decoding could then differ from run to run.)
  * PDL (ridge/kernels/pdl.py): every program waits first (x is the previous kernel's output),
    then lets the next kernel launch.
  * M > 16: BLOCK_M 32. Past 32 rows int4_matmul takes the GEMM (ridge/kernels/int4_gemm.py):
    here every further 32-row block would dequantize every weight again (at M = 64 that made the
    8B gate_up 1.6x slower than the GEMM's 64-row wgmma tiles, BENCHMARKS.md). The kernel still
    runs any M (m-blocks ordered fastest in the grid, so programs sharing a weight tile run
    together and the second read is an L2 hit).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.rounding import round_to
from ridge.kernels.tiles import sm_count

GEMV_MAX_M = 32


def _plane_asm(j: int, magic: int) -> str:
    sel = 0x5410 if j < 4 else 0x7632                 # low halves of both words, or high halves
    shift = f" shr.u32 t, t, {4 * (j % 4)};" if j % 4 else ""
    return (f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {sel:#x};{shift} "
            f"lop3.b32 $0, t, 0xF000F, {magic:#x}, 0xEA; }}")          # (t & 0xF000F) | magic


PLANE_ASM = {dt: tuple(_plane_asm(j, m) for j in range(8))
             for dt, m in (("bf16", 0x43004300), ("fp16", 0x64006400))}
_B0, _B1, _B2, _B3, _B4, _B5, _B6, _B7 = (tl.constexpr(a) for a in PLANE_ASM["bf16"])
_H0, _H1, _H2, _H3, _H4, _H5, _H6, _H7 = (tl.constexpr(a) for a in PLANE_ASM["fp16"])


@triton.jit
def _asm2(w, A: tl.constexpr, DT: tl.constexpr):
    if DT == tl.bfloat16:
        return tl.inline_asm_elementwise(A, "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(A, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _plane(w, J: tl.constexpr, DT: tl.constexpr):
    """Nibble J of every word of w as MAGIC + q in DT (MAGIC 128 for bf16, 1024 for fp16), exact."""
    if DT == tl.bfloat16:
        A: tl.constexpr = (_B0, _B1, _B2, _B3, _B4, _B5, _B6, _B7)[J]
    else:
        A: tl.constexpr = (_H0, _H1, _H2, _H3, _H4, _H5, _H6, _H7)[J]
    return _asm2(w, A, DT)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ptrs (no registers written, no effect on results): issued before
    pdl_wait, the first weight tiles stream in while the previous kernel finishes."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def x_planes(xt):
    """[BM, BK8, 8] -> the eight [BM, BK8] planes x[:, 8i + j], j = 0..7 (register-only splits)."""
    t = tl.reshape(xt, (xt.shape[0], xt.shape[1], 2, 2, 2))
    e, o = tl.split(t)
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def dequant_plane(w, J: tl.constexpr, z, s, SCALE: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr,
                  EMULATE_RNE: tl.constexpr):
    """Weight plane J of the word tile w: q - z exactly, or with SCALE (q - z) * s rounded once, in
    DT (ASM) / fp32 holding DT values (interpreter). z: MAGIC + zero points in DT (ASM) or fp32 zero
    points (interpreter); s: scales, fp32 or (ASM) DT."""
    if ASM:
        q = _plane(w, J, DT) - z                             # q - z, exact in 16 bits
        if SCALE:   # s in DT: a packed 16-bit multiply, rounded once like the fp32 product would be
            q = (q * s).to(DT)                           # (|q - z| <= 16: the product is exact in fp32)
    else:   # the interpreter (no PTX; its 16-bit arithmetic and dot are not float ops): the same
        # values in fp32, the one rounding of SCALE emulated
        q = ((w >> (4 * J)) & 0xF).to(tl.float32) - z
        if SCALE:
            q = round_to(q * s, DT, EMULATE_RNE).to(tl.float32)
    return q


@triton.jit
def _plane_dot(acc, xj, w, J: tl.constexpr, z, s, ROW_SCALES: tl.constexpr, ASM: tl.constexpr,
               EMULATE_RNE: tl.constexpr):
    """acc += x plane J @ (weight plane J - z) [* s]. z: MAGIC + zero points in x's dtype (exact)
    on the GPU, the fp32 zero points in the interpreter."""
    q = dequant_plane(w, J, z, s, ROW_SCALES, xj.dtype, ASM, EMULATE_RNE)
    if ASM:
        acc = tl.dot(xj, q, acc)
    else:   # interpreter: fp32 operands holding 16-bit values, whose products are exact in fp32
        acc = tl.dot(xj.to(tl.float32), q, acc, input_precision="ieee")
    return acc


@triton.jit
def planes_dot(acc, w, z, s, x0, x1, x2, x3, x4, x5, x6, x7, SCALE: tl.constexpr, ASM: tl.constexpr,
                EMULATE_RNE: tl.constexpr):
    """acc += sum over the eight planes j of x plane j @ (plane j of w - z) [* s], on tensor cores."""
    acc = _plane_dot(acc, x0, w, 0, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x1, w, 1, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x2, w, 2, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x3, w, 3, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x4, w, 4, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x5, w, 5, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x6, w, 6, z, s, SCALE, ASM, EMULATE_RNE)
    acc = _plane_dot(acc, x7, w, 7, z, s, SCALE, ASM, EMULATE_RNE)
    return acc


@triton.jit
def splitk_store(acc, Y, P, C, ticket_id, pid_k, offs_m, offs_n, M, N, stride_ym, SPLIT_K: tl.constexpr,
                 EMULATE_RNE: tl.constexpr):
    """Write y = acc, or with SPLIT_K > 1 store this split's partial; the last of the SPLIT_K
    programs of ticket_id sums all partials in split order and writes y (module docstring)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, round_to(acc, Y.dtype.element_ty, EMULATE_RNE), mask=mask)
    else:
        part = P + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()                               # every thread's partial before the ticket
        ticket = tl.atomic_add(C + ticket_id, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):          # fixed order: deterministic sums
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, round_to(total, Y.dtype.element_ty, EMULATE_RNE), mask=mask)
            tl.atomic_xchg(C + ticket_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def _int4_gemv_kernel(X, QW, S, Z, Y, P, C, M, N, stride_xm, stride_ym,
                      K: tl.constexpr, G: tl.constexpr, M_BLOCKS: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                      TILES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                      ROW_SCALES: tl.constexpr, ASM: tl.constexpr, EMULATE_RNE: tl.constexpr,
                      PDL: tl.constexpr, NUM_STAGES: tl.constexpr):
    DT: tl.constexpr = X.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if DT == tl.bfloat16 else 1024.0
    BK8: tl.constexpr = BK // 8
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = (pid % M_BLOCKS) * BM + tl.arange(0, BM)
    offs_n = (pid // M_BLOCKS) * BN + tl.arange(0, BN)
    r = tl.arange(0, BK8)
    e = tl.arange(0, 8)
    n_ok = (offs_n < N)[None, :]
    x_ptrs = X + offs_m[:, None, None] * stride_xm + (r * 8)[None, :, None] + e[None, None, :]
    x_rows = (offs_m < M)[:, None, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PDL and ASM:   # the weights are never written by a step: fetch this program's first tiles
        # into L2 while the previous kernel drains (one address per 128-byte line)
        PF_ROWS: tl.constexpr = BK8 * (2 if TILES > 1 else 1)
        pf_rows = tl.minimum(pid_k * TILES * BK8 + tl.arange(0, PF_ROWS), K // 8 - 1)
        pf_cols = tl.minimum((pid // M_BLOCKS) * BN + tl.arange(0, BN // 32) * 32, N - 1)
        prefetch_l2(QW + pf_rows[:, None] * N + pf_cols[None, :])
    pdl_wait(PDL)                                        # x comes from the previous kernel
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        k0 = (pid_k * TILES + t) * BK
        rows = k0 // 8 + r                               # packed rows of this tile
        if EVEN_K:
            w_mask = n_ok
            x_mask = x_rows
        else:                                            # a tail tile, or one past K: masked out
            w_mask = (rows < K // 8)[:, None] & n_ok
            x_mask = x_rows & (rows < K // 8)[None, :, None]
        if EVEN_N and EVEN_K:
            w = tl.load(QW + rows[:, None] * N + offs_n[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(QW + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0,
                        eviction_policy="evict_first")
        if ROW_SCALES:                                   # group_size < BK: one scale row per word row
            g_ptrs = ((k0 + 8 * r) // G)[:, None] * N + offs_n[None, :]
            s = tl.load(S + g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        else:
            g = tl.minimum(k0, K - 1) // G
            s = tl.load(S + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            z = tl.load(Z + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if ASM:
            z = (z + MAGIC).to(DT)                       # exact: z is an integer in [0, 16]
        x0, x1, x2, x3, x4, x5, x6, x7 = x_planes(tl.load(x_ptrs + k0, mask=x_mask, other=0.0))
        d = tl.zeros((BM, BN), dtype=tl.float32)
        d = planes_dot(d, w, z, s, x0, x1, x2, x3, x4, x5, x6, x7, ROW_SCALES, ASM, EMULATE_RNE)
        if ROW_SCALES:
            acc += d
        else:
            acc += d * s                                 # the group's scale, once per tile
    splitk_store(acc, Y, P, C, pid, pid_k, offs_m, offs_n, M, N, stride_ym, SPLIT_K, EMULATE_RNE)


class Int4GemvConfig(NamedTuple):
    """Launch configuration; split_k ranges of whole K tiles (see int4_gemv_config)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int


def block_m_for(M: int) -> int:
    return 16 if M <= 16 else 32


TILES_PER_PROGRAM = 12


def split_k_for(blocks: int, k_tiles: int, M: int, K: int, num_sms: int, max_split: int = 32) -> int:
    """The power-of-2 split that gives each program about TILES_PER_PROGRAM K tiles (~1,500 K values),
    raised towards 4 programs an SM (blocks x S >= 4 SMs) while a program keeps >= 4 tiles, among
    the splits that divide the tile count (the K loop then needs no masks), keep >= 2 tiles a split
    and keep the fp32 partials written (S x M x N x 4 bytes, read back from L2 by one program per block) <= 1/4 of the weight
    bytes (N x K / 2): S <= K / (32 M).
    Why tiles a program and not one resident wave: each program is latency-bound (a few warps
    walking a dependent chain of loads, dequantization and MMAs), so the kernel runs at the pace of
    the programs in flight; splitting the 70B gate_up (448 blocks) 4 ways, three waves of programs
    instead of one, made it 1.5x faster on an H200; every 70B and 8B projection was fastest at 4-16
    tiles a program, the small outputs (qkv, o: 32-80 blocks) at the short end (short programs pay
    the pipeline's fill and the partials' reduction; long ones leave too few programs in flight).
    BENCHMARKS.md has the sweeps."""
    cap = max(1, min(max_split, k_tiles // 2, K // (32 * M)))
    splits = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= cap and k_tiles % s == 0]
    s = min(splits, key=lambda s: (abs(math.log2(k_tiles / s / TILES_PER_PROGRAM)), -s))
    while blocks * s < 4 * num_sms and 2 * s in splits and k_tiles // (2 * s) >= 4:
        s *= 2
    return s


def int4_gemv_config(M: int, N: int, K: int, group_size: int, num_sms: int = 132,
                     interpret: bool = False) -> Int4GemvConfig:
    """M <= 16: BLOCK_N 128 with 2 warps (64 columns per warp, so each warp's 16-row x plane feeds
    8 MMA n-tiles; 168 registers), BLOCK_K 128 (16 packed rows: the MMA's K of 16 per plane), 3
    stages of cp.async (~12 KB each: 2 tiles in flight per program, up to 6 programs per SM, the
    registers' limit; 3 stages were as fast as 4 or faster on every 70B projection on an H200).
    M > 16 (BLOCK_M 32): 4 warps of 32 columns (2 warps spill at 32 rows: 255 registers + stack
    under Triton 3.9). Narrow outputs (N <= 64): 64 columns, one warp (two at 32 rows). Split-K:
    split_k_for.
    These are first values from the compiled sm_90 code (registers, instructions per weight);
    benchmarks/int4_gemm.py times them. The interpreter gets small tiles so CI stays fast and the
    K tail and the split reduction are exercised."""
    bm = block_m_for(M)
    if interpret:
        bn, bk, warps, stages = 16, 64, 1, 1
    elif N <= 64:
        bn, bk, warps, stages = 64, 128, 1 if bm == 16 else 2, 4
    else:
        bn, bk, warps, stages = 128, 128, 2 if bm == 16 else 4, 3 if bm == 16 else 4
    blocks = triton.cdiv(N, bn) * triton.cdiv(M, bm)
    return Int4GemvConfig(bn, bk, warps, stages, split_k_for(blocks, triton.cdiv(K, bk), M, K, num_sms))


_COUNTERS: dict = {}
COUNTER_SLOTS = 1 << 16


def ticket_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K ticket table: int32, zeroed once; every launch leaves it zeroed again
    (the last program of each block resets its counter). One table per device: INT4 calls on one
    device must not overlap in time on different streams (the engine's forward is one stream;
    a CUDA graph replays its kernels in order)."""
    key = (device.type, device.index)
    c = _COUNTERS.get(key)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4_matmul: call it once on this device before CUDA-graph capture "
                               "(its split-K ticket table is allocated on first use)")
        c = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return c


def int4_gemv(x, qweight, scales, zeros, group_size: int, out: torch.Tensor, config=None) -> torch.Tensor:
    """out = x @ W for validated inputs (int4_matmul checks them): x [M, K] rows contiguous,
    M <= GEMV_MAX_M; out [M, N] in x's dtype."""
    M, K = x.shape
    N = qweight.shape[1]
    interpret = x.device.type != "cuda"
    if config is None:
        sms = sm_count(x.device)
        config = int4_gemv_config(M, N, K, group_size, sms, interpret)
    cfg = Int4GemvConfig(*config)
    bm = block_m_for(M)
    m_blocks = triton.cdiv(M, bm)
    k_tiles = triton.cdiv(K, cfg.block_k)
    tiles = triton.cdiv(k_tiles, cfg.split_k)
    grid = (triton.cdiv(N, cfg.block_n) * m_blocks, cfg.split_k)
    if grid[0] > COUNTER_SLOTS:
        raise ValueError(f"int4_matmul: N = {N} needs {grid[0]} split-K counters, more than {COUNTER_SLOTS}")
    if cfg.split_k > 1:
        partials = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device)
    else:
        partials = counters = out                        # unused
    pdl = use_pdl(x)
    _int4_gemv_kernel[grid](
        x, qweight, scales, zeros, out, partials, counters, M, N, x.stride(0), out.stride(0),
        K=K, G=group_size, M_BLOCKS=m_blocks, BM=bm, BN=cfg.block_n, BK=cfg.block_k,
        SPLIT_K=cfg.split_k, TILES=tiles, EVEN_K=(K % cfg.block_k == 0 and k_tiles % cfg.split_k == 0),
        EVEN_N=N % cfg.block_n == 0, ROW_SCALES=group_size < cfg.block_k and group_size != K, ASM=not interpret,
        EMULATE_RNE=interpret, PDL=pdl, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    return out
