"""W4A16 tensor-core GEMM for batches above the skinny kernel's (M > 32): y = x @ dequantize(qweight), Triton.

ridge's INT4 layout and the reference are in ridge/kernels/int4_matmul.py (the entry point).
Past ~32 rows the skinny kernel (ridge/kernels/int4_gemv.py) would dequantize each weight once
per 32-row block; this kernel is an ordinary Hopper GEMM (wgmma on shared-memory operands, x
tiles pipelined by cp.async, 64-256 rows per tile) whose B tile is produced in registers: the
[BLOCK_K / 8, BLOCK_N] int32 tile (0.5 byte per weight, coalesced along N) is loaded, its eight
nibble planes dequantized by the skinny kernel's packed PTX (two weights per instruction:
128 + q as two 16-bit floats, minus 128 + z exactly, times the scale in one packed multiply,
rounded once as the fp32 product would be), interleaved back into natural K order and stored to
shared memory for the MMA. About 2.5 instructions per weight, spent once per BLOCK_M rows; a
weight in HBM is 4x smaller than bf16 but the MMAs are the same, so from M ~ 128 up the target
is cuBLAS bf16 parity, not a multiple (BENCHMARKS.md has where it stands).

Scales: one row per tile when group_size >= BLOCK_K (the K loop is aligned to groups: BLOCK_K
divides group_size), else one row per packed word row. A short last group (group_size not dividing
K) is the tables' last row, read by the masked K-tail tile (x past the true K loads 0): no padding.
The dequantized weight is rounded to the activation dtype before the MMA (relative 2^-9 for bf16,
per weight, averaging out over K), as a dequantize-then-bf16-matmul would; accumulation is fp32.

Block sizes are autotuned over a short list (each config is a compile at first use; the picks
are cached beside the compiled kernels, `cache_results`). When the M x N tiles cannot fill the
SMs (M = 128 with a 4096-wide output is 32 tiles of 128 x 128) K is split like the skinny
kernel's, reduced in the same launch by the last-ticket program (ridge/kernels/int4_gemv.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ridge.kernels.int4_gemv import COUNTER_SLOTS, dequant_plane, splitk_store, ticket_counters
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.tiles import grouped_tile, sm_count

_INTERPRET = triton.knobs.runtime.interpret
_REF_TILE = 128                  # the tile the split-K decision assumes (the configs' common size)
_MAX_SPLIT = 4


def _configs() -> list[triton.Config]:
    if _INTERPRET:   # the CPU interpreter would run every config: one small one
        return [triton.Config({"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 2}, num_warps=4, num_stages=1)]
    # Hopper: 128-row tiles give each of 2 warpgroups a 64-row wgmma; 64-wide K steps keep the
    # dequantized B tile (BK x BN x 2 bytes) and 3-4 stages of x in shared memory; BN 256 halves
    # the x re-reads for wide outputs; 64-row tiles / 4 warps for the smaller M buckets.
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
                                     (64, 128, 64, 4, 4), (64, 256, 64, 4, 3), (64, 128, 128, 4, 3),
                                     (256, 128, 64, 8, 3))]


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    K, G, M = args["K"], args["G"], args["M"]
    keep = [c for c in configs if c.kwargs["BK"] <= max(64, K) and (G % c.kwargs["BK"] == 0 or G == K
                                                                    or c.kwargs["BK"] % G == 0)]
    keep = [c for c in keep if c.kwargs["BM"] <= max(64, triton.next_power_of_2(M))] or keep
    # 64 x 128 x 128 / 4 warps: the fastest 64-row tile at M = 64 on the 8B qkv, gate_up and down
    # (BENCHMARKS.md), and only there: above, the autotuner (timing L2-resident weights) could take
    # it where streaming weights make it slower
    small = [c for c in keep if (c.kwargs["BM"], c.kwargs["BN"], c.kwargs["BK"]) == (64, 128, 128)]
    keep = (small or keep) if M <= 64 else [c for c in keep if c not in small] or keep
    return keep or configs[:1]


# M_BUCKET is read by the autotuner only (not specialised): the best tile depends on M coarsely,
# and a recompile per distinct M would multiply the compiles.
@triton.autotune(configs=_configs(), key=["N", "K", "G", "M_BUCKET", "SPLIT_K"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=True)
@triton.jit(do_not_specialize=["M_BUCKET"])
def _int4_gemm_kernel(X, QW, S, Z, Y, P, C, M, N, stride_xm, stride_ym, M_BUCKET,
                      K: tl.constexpr, G: tl.constexpr, SPLIT_K: tl.constexpr,
                      EMULATE_RNE: tl.constexpr, PDL: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    DT: tl.constexpr = X.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if DT == tl.bfloat16 else 1024.0
    ASM: tl.constexpr = EMULATE_RNE == 0                 # compiled for the GPU (the PTX dequant)
    BK8: tl.constexpr = BK // 8
    K_TILES: tl.constexpr = (K + BK - 1) // BK
    TILES: tl.constexpr = (K_TILES + SPLIT_K - 1) // SPLIT_K
    EVEN_K: tl.constexpr = K % BK == 0 and K_TILES % SPLIT_K == 0
    ROW_SCALES: tl.constexpr = G < BK and G != K
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    r = tl.arange(0, BK8)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    pdl_wait(PDL)
    for t in tl.range(0, TILES):
        k0 = (pid_k * TILES + t) * BK
        rows = k0 // 8 + r
        if EVEN_K:
            x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
            w_mask = n_ok[None, :]
        else:
            x = tl.load(X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                        mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            w_mask = (rows < K // 8)[:, None] & n_ok[None, :]
        w = tl.load(QW + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
        if ROW_SCALES:
            g_ptrs = ((k0 + 8 * r) // G)[:, None] * N + offs_n[None, :]
            s = tl.load(S + g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        else:
            g = tl.minimum(k0, K - 1) // G
            s = tl.load(S + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(Z + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ASM:
            z = (z + MAGIC).to(DT)                       # exact: z is an integer in [0, 16]
            s = s.to(DT)                                 # exact: the scales are stored in DT
        # the eight planes (q - z) * s of the tile (ridge/kernels/int4_gemv.py), interleaved back
        # into natural K order: [BK8, BN, 8] -> [BK8, 8, BN] -> [BK, BN], row 8i + j = K index k0 + 8i + j
        q0 = dequant_plane(w, 0, z, s, True, DT, ASM, EMULATE_RNE)
        q1 = dequant_plane(w, 1, z, s, True, DT, ASM, EMULATE_RNE)
        q2 = dequant_plane(w, 2, z, s, True, DT, ASM, EMULATE_RNE)
        q3 = dequant_plane(w, 3, z, s, True, DT, ASM, EMULATE_RNE)
        q4 = dequant_plane(w, 4, z, s, True, DT, ASM, EMULATE_RNE)
        q5 = dequant_plane(w, 5, z, s, True, DT, ASM, EMULATE_RNE)
        q6 = dequant_plane(w, 6, z, s, True, DT, ASM, EMULATE_RNE)
        q7 = dequant_plane(w, 7, z, s, True, DT, ASM, EMULATE_RNE)
        wq = tl.join(tl.join(tl.join(q0, q4), tl.join(q2, q6)), tl.join(tl.join(q1, q5), tl.join(q3, q7)))
        wq = tl.reshape(tl.permute(tl.reshape(wq, (BK8, BN, 8)), (0, 2, 1)), (BK, BN))
        if EMULATE_RNE:   # interpreter: its 16-bit dot is not a float dot; products exact in fp32
            acc = tl.dot(x.to(tl.float32), wq.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, wq, acc)
    splitk_store(acc, Y, P, C, pid, pid_k, offs_m, offs_n, M, N, stride_ym, SPLIT_K, EMULATE_RNE)


def gemm_split_k(M: int, N: int, K: int, sms: int) -> int:
    """K ranges per output tile when 128 x 128 tiles leave SMs idle (at most 4, >= 2 K tiles of 128
    each); partial traffic is then M x N x 4 x split bytes, small against an MMA-bound kernel."""
    tiles = triton.cdiv(M, _REF_TILE) * triton.cdiv(N, _REF_TILE)
    s = 1
    while 2 * s <= _MAX_SPLIT and tiles * s < sms and K // (2 * s) >= 2 * _REF_TILE:
        s *= 2
    return s


class Int4GemmConfig(NamedTuple):
    """One tile of the GEMM, launched as given instead of autotuned (benchmarks/int4_gemm.py's sweep)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 0                 # 0: gemm_split_k's


def int4_gemm(x, qweight, scales, zeros, group_size: int, out: torch.Tensor,
              config: Int4GemmConfig | None = None) -> torch.Tensor:
    """out = x @ W for validated inputs (int4_matmul checks them): x [M, K] rows contiguous; config
    fixes the tile (block_k must divide group_size or K, or be a multiple of group_size), else the
    autotuner picks it."""
    M, K = x.shape
    N = qweight.shape[1]
    interpret = x.device.type != "cuda"
    sms = sm_count(x.device)
    c = Int4GemmConfig(*config) if config is not None else None
    split = (c.split_k if c is not None and c.split_k else
             2 if interpret and K >= 4 * 64 else gemm_split_k(M, N, K, sms))
    if split > 1:
        partials = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device)
    else:
        partials = counters = out

    def grid(meta):
        tiles = triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"])
        if split > 1 and tiles > COUNTER_SLOTS:
            raise ValueError(f"int4_matmul: {tiles} output tiles need more than {COUNTER_SLOTS} split-K counters")
        return (tiles, split)

    pdl = use_pdl(x)
    args = (x, qweight, scales, zeros, out, partials, counters, M, N, x.stride(0), out.stride(0),
            min(triton.next_power_of_2(M), 4096))
    consts = dict(K=K, G=group_size, SPLIT_K=split, EMULATE_RNE=interpret, PDL=pdl, **launch_options(pdl))
    if c is None:
        _int4_gemm_kernel[grid](*args, **consts)
    else:
        _int4_gemm_kernel.fn[grid](*args, BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=8,
                                   num_warps=c.num_warps, num_stages=c.num_stages, **consts)
    return out
