"""EXPERIMENT: the shipped M > 64 GEMM with the packed PTX dequant (q - z exact) and the group
scale applied after the MMA; explicit configs for a sweep."""
import torch
import triton
import triton.language as tl

from ridge.kernels.int4_gemv import COUNTER_SLOTS, dequant_plane, splitk_store, ticket_counters
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl


@triton.jit(do_not_specialize=["M_BUCKET"])
def _gemm2_kernel(X, QW, S, Z, Y, P, C, M, N, stride_xm, stride_ym, M_BUCKET,
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
    # grouped order: GROUP_M row blocks sweep the same column blocks together (x and W reuse in L2)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    m_blocks = tl.cdiv(M, BM)
    n_blocks = tl.cdiv(N, BN)
    group = pid // (GROUP_M * n_blocks)
    first_m = group * GROUP_M
    rows_here = tl.minimum(m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_blocks)) % rows_here
    pid_n = (pid % (GROUP_M * n_blocks)) // rows_here
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
        # the eight planes (q - z) * s of the tile (ridge/kernels/int4_gemv.py), interleaved back
        # into natural K order: [BK8, BN, 8] -> [BK8, 8, BN] -> [BK, BN], row 8i + j = K index k0 + 8i + j
        q0 = dequant_plane(w, 0, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q1 = dequant_plane(w, 1, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q2 = dequant_plane(w, 2, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q3 = dequant_plane(w, 3, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q4 = dequant_plane(w, 4, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q5 = dequant_plane(w, 5, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q6 = dequant_plane(w, 6, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        q7 = dequant_plane(w, 7, z, s, ROW_SCALES, DT, ASM, EMULATE_RNE)
        wq = tl.join(tl.join(tl.join(q0, q4), tl.join(q2, q6)), tl.join(tl.join(q1, q5), tl.join(q3, q7)))
        wq = tl.reshape(tl.permute(tl.reshape(wq, (BK8, BN, 8)), (0, 2, 1)), (BK, BN))
        if EMULATE_RNE:
            d = tl.dot(x.to(tl.float32), wq.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(x, wq)
        if ROW_SCALES:
            acc += d
        else:
            acc += d * s
    splitk_store(acc, Y, P, C, pid, pid_k, offs_m, offs_n, M, N, stride_ym, SPLIT_K, EMULATE_RNE)




def int4_gemm2(x, qweight, scales, zeros, group_size, out, bm, bn, bk, warps, stages, split=1, group_m=8):
    M, K = x.shape
    N = qweight.shape[1]
    interpret = x.device.type != "cuda"
    if split > 1:
        partials = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        counters = ticket_counters(x.device)
    else:
        partials = counters = out
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    pdl = use_pdl(x)
    _gemm2_kernel[(tiles, split)](x, qweight, scales, zeros, out, partials, counters, M, N, x.stride(0), out.stride(0),
                                 0, K=K, G=group_size, SPLIT_K=split, EMULATE_RNE=interpret, PDL=pdl,
                                 BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages,
                                 **launch_options(pdl))
    return out
