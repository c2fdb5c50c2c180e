"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3's scaling): y = x @ W^T with e4m3 operands, Triton.

The scheme (DeepGEMM's): activations are quantized per token and per 128 input channels (one fp32
scale per 1 x 128 group, `quantize_act_fp8`), weights per 128 x 128 block
(ridge/layers/quant/fp8.py); the tensor cores multiply e4m3 x e4m3 into fp32, and each K block of
128 is *promoted* on its own: its partial sum, exact to fp32 inside the block, is scaled by the
token's and the weight block's scale and added to an fp32 accumulator in registers. So no scale
ever rounds into an operand, and the MMA's limited-precision accumulation (Hopper's FP8 MMA keeps
~14 bits) spans only 128 products before it is promoted.

Why it pays: an e4m3 MMA does twice the FLOPs of a bf16 one per cycle (ridge's roofline measures
the two roofs), and the operands are half the bytes. It pays only when the GEMM is compute-bound:
at decode sizes the extra activation-quantization pass and the scale loads cost more than the
halved weight bytes save against a tuned bf16 GEMV, which is why the engine is to time this
kernel against cuBLAS's block-scaled torch._scaled_mm and the bf16 path per shape and M bucket and
dispatch to the fastest (issue 16); until that timing exists nothing dispatches here.

Layout: x [M, K] e4m3 rows contiguous, x_scale [M, ceil(K / 128)] fp32; w [N, K] e4m3 (the
checkpoint's orientation), w_scale [ceil(N / 128), ceil(K / 128)] fp32; y [M, N] bf16 or fp16.
Ragged M, N, K are masked (a K tail reads zeros, which add nothing). Grouped raster order
(GROUP_M row blocks sweep the same column blocks) keeps x and w tiles in L2 across neighbours.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.rounding import emulate_rne, round_to
from ridge.kernels.tiles import grouped_tile

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0      # the largest finite e4m3fn value
GROUP = 128          # activation group and weight block: the promotion interval
_AMAX_FLOOR = 1e-10  # an all-zero group gets a tiny scale, not a division by zero


def as_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [N / bn, bn, K / bk, bk], zero-padded to whole blocks (the weights' 128 x 128
    blocks, the activations' 1 x 128 groups)."""
    (n, k), (bn, bk) = w.shape, block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w.reshape((n + pn) // bn, bn, (k + pk) // bk, bk)


# ------------------------------------------------------------------------- activation quantization
def quantize_act_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / 128)]): per token and 128 channels,
    scale = amax / 448, q = x / scale rounded to e4m3 (the kernel's arithmetic, in torch)."""
    m, k = x.shape
    xf = as_blocks(x.float(), (1, GROUP))[:, 0]                       # [M, K / 128, 128]
    scale = xf.abs().amax(dim=2).clamp(min=_AMAX_FLOOR) / FP8_MAX
    q = (xf / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(m, -1)[:, :k]
    return q.contiguous(), scale


@triton.jit
def _quantize_act_kernel(X, Q, S, K, stride_xm, stride_qm, KB: tl.constexpr, G: tl.constexpr,
                         EMULATE_RNE: tl.constexpr):
    row = tl.program_id(0)
    kb = tl.program_id(1)
    offs = kb * G + tl.arange(0, G)
    ok = offs < K
    x = tl.load(X + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / 448.0
    q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(Q + row * stride_qm + offs, round_to(q, tl.float8e4nv, EMULATE_RNE), mask=ok)
    tl.store(S + row * KB + kb, scale)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act_fp8_ref as one Triton pass (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"quantize_act_fp8: x must be a 2-D float tensor with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    kb = triton.cdiv(k, GROUP)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_act_kernel[(m, kb)](x, q, s, k, x.stride(0), q.stride(0), KB=kb, G=GROUP,
                                      EMULATE_RNE=emulate_rne(x))
    return q, s


# ---------------------------------------------------------------------------------------- the GEMM
def fp8_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The block-scaled product in float32: per K block, (x_q @ w_q^T) x x_scale x w_scale, summed."""
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.zeros((m, n), dtype=torch.float32, device=xq.device)
    for b in range(triton.cdiv(k, GROUP)):
        ks = slice(b * GROUP, min(k, (b + 1) * GROUP))
        part = xq[:, ks].float() @ wq[:, ks].float().t()
        ws = w_scale[:, b].float().repeat_interleave(GROUP)[:n]
        y += part * x_scale[:, b:b + 1].float() * ws[None, :]
    return y.to(out_dtype)


@triton.jit
def _fp8_gemm_kernel(X, XS, W, WS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                     KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, EMULATE_RNE: tl.constexpr):
    BK: tl.constexpr = 128
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(0, KB):
        k = kb * BK + offs_k
        if EVEN_K:
            x_mask = m_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            x_mask = m_ok[:, None] & (k < K)[None, :]
            w_mask = n_ok[None, :] & (k < K)[:, None]
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)     # [BK, BN]
        part = tl.dot(x, w)                                        # exact to fp32 within the block
        xs = tl.load(XS + offs_m * KB + kb, mask=m_ok, other=0.0)
        ws = tl.load(WS + (offs_n // BK) * KB + kb, mask=n_ok, other=0.0)
        acc += part * xs[:, None] * ws[None, :]                    # promotion, once per K block
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, round_to(acc, Y.dtype.element_ty, EMULATE_RNE), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, block_m: int = 128, block_n: int = 128,
             num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = the block-scaled product (fp8_gemm_ref's), in out_dtype. Tile sizes are arguments
    until a GPU sweep picks them per shape; block_n must divide 128 (a weight scale block)."""
    if xq.dtype != FP8 or wq.dtype != FP8 or xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"fp8_gemm: x and w must be float8_e4m3fn [M, K] and [N, K], got {xq.dtype} "
                         f"{tuple(xq.shape)} and {wq.dtype} {tuple(wq.shape)}")
    (m, k), n = xq.shape, wq.shape[0]
    kb = triton.cdiv(k, GROUP)
    for name, t, shape in (("x_scale", x_scale, (m, kb)), ("w_scale", w_scale, (triton.cdiv(n, GROUP), kb))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"fp8_gemm: {name} must be float32 {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    if GROUP % block_n or xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError("fp8_gemm: block_n must divide 128, and x and w need contiguous rows")
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m and n:
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _fp8_gemm_kernel[grid](xq, x_scale, wq, w_scale, y, m, n, k, xq.stride(0), wq.stride(0), y.stride(0),
                               KB=kb, BM=block_m, BN=block_n, GROUP_M=8, EVEN_K=k % GROUP == 0,
                               EMULATE_RNE=emulate_rne(xq),
                               num_warps=num_warps, num_stages=num_stages)
    return y
