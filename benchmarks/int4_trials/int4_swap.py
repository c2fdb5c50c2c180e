"""EXPERIMENT (not shipped): W4A16 GEMM with swapped operands: y^T = W^T x^T, the dequantized
weight plane as wgmma's A operand straight from registers, x planes as B (smem)."""
import torch
import triton
import triton.language as tl

from ridge.kernels.int4_gemv import COUNTER_SLOTS, dequant_plane, num_sms, ticket_counters, x_planes
from ridge.kernels.rounding import round_to
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl


@triton.jit
def _pdot(acc, w, xj, J: tl.constexpr, z, s, ROW_SCALES: tl.constexpr, ASM: tl.constexpr, EMULATE_RNE: tl.constexpr):
    q = dequant_plane(w, J, z, s, ROW_SCALES, xj.dtype, ASM, EMULATE_RNE)      # [BN, BK8]
    if ASM:
        acc = tl.dot(q, xj, acc)
    else:
        acc = tl.dot(q, xj.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _swap_kernel(X, QW, S, Z, Y, P, C, M, N, stride_xm, stride_ym,
                 K: tl.constexpr, G: tl.constexpr, M_BLOCKS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                 TILES: tl.constexpr, EVEN_K: tl.constexpr, ROW_SCALES: tl.constexpr, ASM: tl.constexpr,
                 EMULATE_RNE: tl.constexpr, PDL: tl.constexpr, NUM_STAGES: tl.constexpr):
    DT: tl.constexpr = X.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if DT == tl.bfloat16 else 1024.0
    BK8: tl.constexpr = BK // 8
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = (pid % M_BLOCKS) * BM + tl.arange(0, BM)
    offs_n = (pid // M_BLOCKS) * BN + tl.arange(0, BN)
    r = tl.arange(0, BK8)
    e = tl.arange(0, 8)
    n_ok = (offs_n < N)[:, None]
    # x^T tile as [BK8, BM, 8]: element (i, m, j) = x[m, k0 + 8 i + j]
    x_ptrs = X + offs_m[None, :, None] * stride_xm + (r * 8)[:, None, None] + e[None, None, :]
    x_rows = (offs_m < M)[None, :, None]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    pdl_wait(PDL)
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        k0 = (pid_k * TILES + t) * BK
        rows = k0 // 8 + r
        if EVEN_K:
            w_mask = n_ok
            x_mask = x_rows
        else:
            w_mask = (rows < K // 8)[None, :] & n_ok
            x_mask = x_rows & (rows < K // 8)[:, None, None]
        w = tl.load(QW + rows[None, :] * N + offs_n[:, None], mask=w_mask, other=0)       # [BN, BK8]
        if ROW_SCALES:
            g_ptrs = ((k0 + 8 * r) // G)[None, :] * N + offs_n[:, None]
            s = tl.load(S + g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            z = tl.load(Z + g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        else:
            g = tl.minimum(k0, K - 1) // G
            s = tl.load(S + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            z = tl.load(Z + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        if ASM:
            z = (z + MAGIC).to(DT)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_planes(tl.load(x_ptrs + k0, mask=x_mask, other=0.0))   # [BK8, BM]
        d = tl.zeros((BN, BM), dtype=tl.float32)
        d = _pdot(d, w, x0, 0, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x1, 1, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x2, 2, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x3, 3, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x4, 4, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x5, 5, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x6, 6, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        d = _pdot(d, w, x7, 7, z, s, ROW_SCALES, ASM, EMULATE_RNE)
        if ROW_SCALES:
            acc += d
        else:
            acc += d * s
    # store y[m, n] = acc[n, m] (split-K: the same ticket scheme as the skinny kernel, transposed)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, round_to(acc, Y.dtype.element_ty, EMULATE_RNE), mask=mask)
    else:
        part = P + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(C + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for sp in tl.static_range(SPLIT_K):
                total += tl.load(part + sp * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, round_to(total, Y.dtype.element_ty, EMULATE_RNE), mask=mask)
            tl.atomic_xchg(C + pid, 0, sem="relaxed", scope="gpu")


def int4_swap(x, qweight, scales, zeros, group_size, out, bm, bn=128, bk=128, warps=4, stages=3, split=1):
    M, K = x.shape
    N = qweight.shape[1]
    interpret = x.device.type != "cuda"
    m_blocks = triton.cdiv(M, bm)
    k_tiles = triton.cdiv(K, bk)
    tiles = triton.cdiv(k_tiles, split)
    grid = (triton.cdiv(N, bn) * m_blocks, split)
    if split > 1:
        assert grid[0] <= COUNTER_SLOTS
        partials = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device)
    else:
        partials = counters = out
    pdl = use_pdl(x)
    _swap_kernel[grid](x, qweight, scales, zeros, out, partials, counters, M, N, x.stride(0), out.stride(0),
                       K=K, G=group_size, M_BLOCKS=m_blocks, BM=bm, BN=bn, BK=bk, SPLIT_K=split, TILES=tiles,
                       EVEN_K=(K % bk == 0 and k_tiles % split == 0),
                       ROW_SCALES=group_size < bk and group_size != K, ASM=not interpret, EMULATE_RNE=interpret,
                       PDL=pdl, NUM_STAGES=stages, num_warps=warps, num_stages=stages, **launch_options(pdl))
    return out
