"""INT4 experts read as the dense INT4 GEMV reads its weights: nibble planes. The small-batch path's
kernels, and the grouped GEMM's K loop for 128-wide tiles.

ridge/kernels/moe_gemm.py's kernels read every format through `load_weight_tile`, which for INT4
loads each weight's 32-bit word on its own (a 4-byte cp.async a weight), then shifts, masks,
converts, subtracts, scales and rounds it: ~13 SASS instructions a weight for small gate/up, ~22
for small down and for the grouped GEMM, with spills (`benchmarks/kernel_sass.py`), against 2-6 for
bf16, so a quarter of the bytes came out 3-5x slower end to end. Here, as in ridge/kernels/int4_gemv.py:

  * A word tile [BLOCK_N, BLOCK_K / 8] is one vector load (the codes are packed along K, rows
    contiguous), and nibble j of every word is the weight plane of the K indices 8 i + j; x is
    loaded [BLOCK_K / 8, 8] and split into the matching planes in registers. Each plane is
    multiplied by its x plane, so the K order is permuted, which a sum does not notice.
  * On the GPU a plane comes out two weights an instruction sequence (prmt, shr, lop3: 16-bit
    floats MAGIC + q, exact), and one packed subtraction of MAGIC + z gives q - z exactly.
  * Small path: the group's scale multiplies the tile's fp32 partial sums once (a K tile lies in
    one group: BLOCK_K divides 128), not every weight. So each weight is (q - z) exactly times x in fp32,
    scaled after the sum: not rounded to the activation dtype first as the reference's
    dequantized weight is (the dense INT4 kernels do the same; the sums agree to fp32 rounding).
    Gate/up with 128-wide K tiles puts each plane on tensor cores (the pair's row padded to 16).
  * Grouped path (`grouped_int4_planes`): 16+ rows share each dequantized plane, so it is rounded
    as the reference's weight, (q - z) * s in the activation dtype (one more packed multiply),
    and the MMA takes it: the generic path's sums, at a quarter of its instructions a weight.

Under TRITON_INTERPRET the planes come from plain integer ops (ASM off), with the same values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.int4_gemv import dequant_plane, planes_dot, x_planes
from ridge.kernels.moe_quant import INT4_GROUP, small_down_program, small_gate_up_program
from ridge.kernels.rounding import round_to
from ridge.kernels.silu_mul import silu_mul_sums


@triton.jit
def _planes_fma(acc, w, z, x0, x1, x2, x3, x4, x5, x6, x7, DT: tl.constexpr, ASM: tl.constexpr):
    """acc += sum over the eight planes j of (plane j of w - z) * x plane j (fp32)."""
    acc += dequant_plane(w, 0, z, z, False, DT, ASM, False).to(tl.float32) * x0
    acc += dequant_plane(w, 1, z, z, False, DT, ASM, False).to(tl.float32) * x1
    acc += dequant_plane(w, 2, z, z, False, DT, ASM, False).to(tl.float32) * x2
    acc += dequant_plane(w, 3, z, z, False, DT, ASM, False).to(tl.float32) * x3
    acc += dequant_plane(w, 4, z, z, False, DT, ASM, False).to(tl.float32) * x4
    acc += dequant_plane(w, 5, z, z, False, DT, ASM, False).to(tl.float32) * x5
    acc += dequant_plane(w, 6, z, z, False, DT, ASM, False).to(tl.float32) * x6
    acc += dequant_plane(w, 7, z, z, False, DT, ASM, False).to(tl.float32) * x7
    return acc


@triton.jit
def _zero_points(Z, offs, mask, DT: tl.constexpr, ASM: tl.constexpr):
    """Zero points as dequant_plane takes them: MAGIC + z in DT on the GPU, fp32 in the interpreter."""
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    if ASM:
        z = (z + (128.0 if DT == tl.bfloat16 else 1024.0)).to(DT)
    return z


@triton.jit
def _scales(S, offs, mask, DT: tl.constexpr, ASM: tl.constexpr):
    """Group scales as dequant_plane multiplies by them: in DT on the GPU, fp32 in the interpreter."""
    s = tl.load(S + offs, mask=mask, other=0.0)
    return s.to(DT) if ASM else s.to(tl.float32)


@triton.jit
def _small_gate_up_int4_kernel(X, W, WS, WZ, Experts, Out, inter, K: tl.constexpr, TOP_K: tl.constexpr, stride_xt,
                               stride_we, stride_wn, stride_se, stride_sn, stride_ot, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr,
                               PDL: tl.constexpr, ASM: tl.constexpr):
    DT: tl.constexpr = X.dtype.element_ty
    BK8: tl.constexpr = BLOCK_K // 8
    pair, offs_n, n_mask, e = small_gate_up_program(Experts, inter, BLOCK_N, PDL)
    r = tl.arange(0, BK8)
    w_gate = W + e * stride_we + offs_n[:, None] * stride_wn + r[None, :]
    w_up = w_gate + inter * stride_wn
    sz_gate = e * stride_se + offs_n * stride_sn
    sz_up = sz_gate + inter * stride_sn
    x_row = X + (pair // TOP_K) * stride_xt + (8 * r)[:, None] + tl.arange(0, 8)[None, :]
    acc_g = tl.zeros([BLOCK_N, BK8], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BK8], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        r_ok = r < (K - k) // 8                                 # K is a multiple of 8
        m = n_mask[:, None] & r_ok[None, :]
        wg = tl.load(w_gate + k // 8, mask=m, other=0, eviction_policy="evict_first")
        wu = tl.load(w_up + k // 8, mask=m, other=0, eviction_policy="evict_first")
        xt = tl.load(x_row + k, mask=r_ok[:, None], other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_planes(tl.reshape(xt, (1, BK8, 8)))
        g = k // 128
        zg = _zero_points(WZ, sz_gate + g, n_mask, DT, ASM)[:, None]
        zu = _zero_points(WZ, sz_up + g, n_mask, DT, ASM)[:, None]
        tg = _planes_fma(tl.zeros([BLOCK_N, BK8], dtype=tl.float32), wg, zg, x0, x1, x2, x3, x4, x5, x6, x7, DT, ASM)
        tu = _planes_fma(tl.zeros([BLOCK_N, BK8], dtype=tl.float32), wu, zu, x0, x1, x2, x3, x4, x5, x6, x7, DT, ASM)
        acc_g += tg * tl.load(WS + sz_gate + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        acc_u += tu * tl.load(WS + sz_up + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y = silu_mul_sums(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), Out.dtype.element_ty, EMULATE_RNE)
    tl.store(Out + pair * stride_ot + offs_n, y, mask=n_mask)


@triton.jit
def _small_gate_up_int4_mma_kernel(X, W, WS, WZ, Experts, Out, inter, K: tl.constexpr, TOP_K: tl.constexpr, stride_xt,
                                   stride_we, stride_wn, stride_se, stride_sn, stride_ot, BLOCK_N: tl.constexpr,
                                   NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr, PDL: tl.constexpr,
                                   ASM: tl.constexpr):
    """The gate/up kernel on tensor cores (BLOCK_K 128: planes 16 deep, the MMA's K): the pair's x
    row is row 0 of a 16-row operand (the other rows zero, free: the kernel is bound by the weights),
    and each plane is one tl.dot, so the multiply-add and the conversion to fp32 leave the issue slots."""
    DT: tl.constexpr = X.dtype.element_ty
    pair, offs_n, n_mask, e = small_gate_up_program(Experts, inter, BLOCK_N, PDL)
    r = tl.arange(0, 16)
    first = (tl.arange(0, 16) == 0)
    w_gate = W + e * stride_we + offs_n[None, :] * stride_wn + r[:, None]       # [16 words of K, BLOCK_N]
    w_up = w_gate + inter * stride_wn
    sz_gate = e * stride_se + offs_n * stride_sn
    sz_up = sz_gate + inter * stride_sn
    x_row = X + (pair // TOP_K) * stride_xt + (8 * r)[:, None] + tl.arange(0, 8)[None, :]
    acc_g = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, 128, num_stages=NUM_STAGES):
        r_ok = r < (K - k) // 8                                 # K is a multiple of 8
        m = r_ok[:, None] & n_mask[None, :]
        wg = tl.load(w_gate + k // 8, mask=m, other=0, eviction_policy="evict_first")
        wu = tl.load(w_up + k // 8, mask=m, other=0, eviction_policy="evict_first")
        xt = tl.load(x_row + k, mask=r_ok[:, None], other=0.0)
        x16 = tl.where(first[:, None, None], xt[None, :, :], tl.zeros_like(xt)[None, :, :])
        x0, x1, x2, x3, x4, x5, x6, x7 = x_planes(x16)          # [16, 16] each, row 0 the pair's
        g = k // 128
        zg = _zero_points(WZ, sz_gate + g, n_mask, DT, ASM)[None, :]
        zu = _zero_points(WZ, sz_up + g, n_mask, DT, ASM)[None, :]
        dg = planes_dot(tl.zeros([16, BLOCK_N], dtype=tl.float32), wg, zg, zg, x0, x1, x2, x3, x4, x5, x6, x7, False,
                         ASM, False)
        du = planes_dot(tl.zeros([16, BLOCK_N], dtype=tl.float32), wu, zu, zu, x0, x1, x2, x3, x4, x5, x6, x7, False,
                         ASM, False)
        acc_g += dg * tl.load(WS + sz_gate + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += du * tl.load(WS + sz_up + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    g_row = tl.sum(tl.where(first[:, None], acc_g, 0.0), axis=0)
    u_row = tl.sum(tl.where(first[:, None], acc_u, 0.0), axis=0)
    y = silu_mul_sums(g_row, u_row, Out.dtype.element_ty, EMULATE_RNE)
    tl.store(Out + pair * stride_ot + offs_n, y, mask=n_mask)


@triton.jit
def grouped_int4_planes(X, x_rows, valid, stride_xm, W, WS, WZ, e, offs_n, n_mask, N, K, stride_we, stride_wn,
                        stride_se, stride_sn, acc, acc_u, GATED: tl.constexpr, ASM: tl.constexpr,
                        EMULATE_RNE: tl.constexpr):
    """The grouped GEMM's K loop (ridge/kernels/moe_gemm.py) for INT4 experts, one group a step (128
    inputs: planes 16 words deep, the MMA's K): acc [BLOCK_M, BLOCK_N] += the rows x_rows of X @ expert
    e's columns offs_n (and acc_u += the same @ its up columns N + offs_n if GATED). The word tile is one
    vector load; each weight plane is dequantized as the reference rounds it, (q - z) * s in X's dtype
    (one packed multiply two weights), so the sums are those of the generic path's dequantized tile:
    at 16+ rows a tile the per-weight work is shared by the rows, and the scale costs no extra
    accumulator."""
    DT: tl.constexpr = X.dtype.element_ty
    r = tl.arange(0, 16)
    x_ptrs = X + x_rows[:, None, None] * stride_xm + (8 * r)[None, :, None] + tl.arange(0, 8)[None, None, :]
    w_ptrs = W + e * stride_we + offs_n[None, :] * stride_wn + r[:, None]        # [16 words of K, BLOCK_N]
    sz = e * stride_se + offs_n * stride_sn
    for k in range(0, K, 128):
        r_ok = r < (K - k) // 8                                 # K is a multiple of 8
        xt = tl.load(x_ptrs + k, mask=valid[:, None, None] & r_ok[None, :, None], other=0.0)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_planes(xt)           # [BLOCK_M, 16] each
        m = r_ok[:, None] & n_mask[None, :]
        g = k // 128
        w = tl.load(w_ptrs + k // 8, mask=m, other=0)
        z = _zero_points(WZ, sz + g, n_mask, DT, ASM)[None, :]
        s = _scales(WS, sz + g, n_mask, DT, ASM)[None, :]
        acc = planes_dot(acc, w, z, s, x0, x1, x2, x3, x4, x5, x6, x7, True, ASM, EMULATE_RNE)
        if GATED:
            wu = tl.load(w_ptrs + N * stride_wn + k // 8, mask=m, other=0)
            zu = _zero_points(WZ, sz + N * stride_sn + g, n_mask, DT, ASM)[None, :]
            su = _scales(WS, sz + N * stride_sn + g, n_mask, DT, ASM)[None, :]
            acc_u = planes_dot(acc_u, wu, zu, su, x0, x1, x2, x3, x4, x5, x6, x7, True, ASM, EMULATE_RNE)
    return acc, acc_u


@triton.jit
def _small_down_int4_kernel(Hid, W, WS, WZ, Experts, RouteW, Out, N, K: tl.constexpr, TOP_K: tl.constexpr,
                            stride_hp, stride_we, stride_wn, stride_se, stride_sn, stride_ot, BLOCK_TK: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                            EMULATE_RNE: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    DT: tl.constexpr = Hid.dtype.element_ty
    BK8: tl.constexpr = BLOCK_K // 8
    t, offs_n, n_mask, js, j_mask, e = small_down_program(Experts, N, TOP_K, BLOCK_TK, BLOCK_N, PDL)
    r = tl.arange(0, BK8)
    # all top_k experts' word tiles in one [TOP_K, BLOCK_N, BLOCK_K / 8] load
    w_rows = W + e[:, None, None] * stride_we + offs_n[None, :, None] * stride_wn + r[None, None, :]
    row_mask = j_mask[:, None] & n_mask[None, :]
    sz = e[:, None] * stride_se + offs_n[None, :] * stride_sn
    h_rows = Hid + (t * TOP_K + js)[:, None, None] * stride_hp + (8 * r)[None, :, None] + tl.arange(0, 8)[None, None, :]
    acc = tl.zeros([BLOCK_TK, BLOCK_N, BK8], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        r_ok = r < (K - k) // 8
        w = tl.load(w_rows + k // 8, mask=row_mask[:, :, None] & r_ok[None, None, :], other=0,
                    eviction_policy="evict_first")
        h = tl.load(h_rows + k, mask=j_mask[:, None, None] & r_ok[None, :, None], other=0.0).to(tl.float32)
        h0, h1, h2, h3, h4, h5, h6, h7 = x_planes(h)           # [BLOCK_TK, BK8] each
        g = k // 128
        z = _zero_points(WZ, sz + g, row_mask, DT, ASM)[:, :, None]
        d = _planes_fma(tl.zeros([BLOCK_TK, BLOCK_N, BK8], dtype=tl.float32), w, z, h0[:, None, :], h1[:, None, :],
                        h2[:, None, :], h3[:, None, :], h4[:, None, :], h5[:, None, :], h6[:, None, :], h7[:, None, :],
                        DT, ASM)
        acc += d * tl.load(WS + sz + g, mask=row_mask, other=0.0).to(tl.float32)[:, :, None]
    y = round_to(tl.sum(acc, axis=2), Out.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    rw = round_to(tl.load(RouteW + t * TOP_K + js, mask=j_mask, other=0.0), Out.dtype.element_ty, EMULATE_RNE)
    routed = round_to(y * rw.to(tl.float32)[:, None], Out.dtype.element_ty, EMULATE_RNE).to(tl.float32)
    tl.store(Out + t * stride_ot + offs_n, round_to(tl.sum(routed, axis=0), Out.dtype.element_ty, EMULATE_RNE),
             mask=n_mask)


def small_int4(x, hidden, out, w13, w2, weights, experts, gu, dn, dn_k: int, pdl: bool, rne: bool, launch: dict):
    """The two small-path launches for Int4Experts (moe_gemm.fused_moe_small checks and allocates)."""
    (T, H), top_k = x.shape, experts.shape[1]
    inter = w13.q.shape[1] // 2
    asm = planes_asm(x)
    args = (x, w13.q, w13.scale, w13.zero, experts, hidden, inter, H, top_k, x.stride(0), w13.q.stride(0),
            w13.q.stride(1), w13.scale.stride(0), w13.scale.stride(1), hidden.stride(0))
    grid = (T * top_k, triton.cdiv(inter, gu.block_n))
    if gu.block_k == INT4_GROUP:   # planes 16 words deep: the MMA's K
        _small_gate_up_int4_mma_kernel[grid](*args, BLOCK_N=gu.block_n, NUM_STAGES=gu.num_stages, EMULATE_RNE=rne,
                                             PDL=pdl, ASM=asm, num_warps=gu.num_warps, **launch)
    else:
        _small_gate_up_int4_kernel[grid](*args, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, NUM_STAGES=gu.num_stages,
                                         EMULATE_RNE=rne, PDL=pdl, ASM=asm, num_warps=gu.num_warps, **launch)
    _small_down_int4_kernel[(T, triton.cdiv(H, dn.block_n))](
        hidden, w2.q, w2.scale, w2.zero, experts, weights, out, H, inter, top_k, hidden.stride(0), w2.q.stride(0),
        w2.q.stride(1), w2.scale.stride(0), w2.scale.stride(1), out.stride(0), BLOCK_TK=triton.next_power_of_2(top_k),
        BLOCK_N=dn.block_n, BLOCK_K=dn_k, NUM_STAGES=dn.num_stages, EMULATE_RNE=rne, PDL=pdl, ASM=asm,
        num_warps=dn.num_warps, **launch)
    return out


def planes_asm(x) -> bool:
    """Whether the plane kernels take their nibbles with PTX (16-bit activations on the GPU); else
    (the interpreter, fp32 models) plain integer ops give the same values."""
    return not triton.knobs.runtime.interpret and x.dtype in (torch.bfloat16, torch.float16)
