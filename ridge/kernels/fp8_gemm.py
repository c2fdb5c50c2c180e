"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3's scaling): y = x @ W^T with e4m3 operands, Triton.

The scheme (DeepGEMM's): activations are quantized per token and per 128 input channels (one fp32
scale per 1 x 128 group, `quantize_act_fp8`), weights per 128 x 128 block
(ridge/layers/quant/fp8/formats.py); the tensor cores multiply e4m3 x e4m3 into fp32, and each K block of
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
from triton.tools.tensor_descriptor import TensorDescriptor

from ridge.kernels.rounding import emulate_rne, round_to
from ridge.kernels.tiles import grouped_tile, sm_count

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
def quantize_groups(x, EMULATE_RNE: tl.constexpr):
    """x: fp32 [R, 128], one token's 128-channel group a row -> (e4m3 [R, 128], fp32 scales [R]):
    quantize_act_fp8_ref's arithmetic, the one copy of it in Triton (the standalone pass below and
    the producers that fuse it: ridge/kernels/rmsnorm.py, silu_mul.py). The e4m3 result goes
    straight to memory: converting it back to fp32 in the same kernel is what Triton 3.6
    miscompiles on Hopper (ridge/kernels/rounding.py)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    return round_to(q, tl.float8e4nv, EMULATE_RNE), scale


@triton.jit
def _quantize_act_kernel(X, Q, S, M, K, stride_xm, stride_qm, G: tl.constexpr, BLOCK_M: tl.constexpr,
                         EMULATE_RNE: tl.constexpr):
    """One [BLOCK_M tokens, 128 channels] tile a program: enough bytes in flight to stream (one
    128-channel group a program left the kernel ~5x off copy bandwidth), and the tile's BLOCK_M
    scales are one contiguous M-major store."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    offs = kb * G + tl.arange(0, G)
    ok = (rows[:, None] < M) & (offs[None, :] < K)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, EMULATE_RNE)
    tl.store(Q + rows[:, None].to(tl.int64) * stride_qm + offs[None, :], q, mask=ok)
    tl.store(S + kb * M + rows, scale, mask=rows < M)        # M-major: the GEMM's loads are coalesced


def empty_act_fp8(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for a quantized activation: (e4m3 [M, K], fp32 scales [M, ceil(K / 128)] M-major, i.e. a
    [K / 128, M] buffer seen as [M, K / 128]), the layout DeepGEMM and cuBLAS's block-scaled GEMM
    read: one K block's scales for a tile of tokens are contiguous."""
    q = torch.empty((m, k), dtype=FP8, device=device)
    return q, torch.empty((triton.cdiv(k, GROUP), m), dtype=torch.float32, device=device).t()


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act_fp8_ref as one Triton pass (CUDA tensors, or CPU under TRITON_INTERPRET=1), the
    scales M-major (empty_act_fp8's layout)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"quantize_act_fp8: x must be a 2-D float tensor with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q, s = empty_act_fp8(m, k, x.device)
    if m and k:
        block_m = min(32, triton.next_power_of_2(m))
        _quantize_act_kernel[(triton.cdiv(m, block_m), triton.cdiv(k, GROUP))](
            x, q, s, m, k, x.stride(0), q.stride(0), G=GROUP, BLOCK_M=block_m, EMULATE_RNE=emulate_rne(x),
            num_warps=4)
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
def _promoted_block(x, w_t, XS, WS, offs_m, offs_n, m_ok, n_ok, kb, stride_xsm, stride_xsk, KB: tl.constexpr):
    """One K block's exact fp32 partial sum, scaled by the token's and the weight block's scale."""
    part = tl.dot(x, w_t)
    xs = tl.load(XS + offs_m * stride_xsm + kb * stride_xsk, mask=m_ok, other=0.0)
    ws = tl.load(WS + (offs_n // 128) * KB + kb, mask=n_ok, other=0.0)
    return part * xs[:, None] * ws[None, :]


@triton.jit
def _fp8_gemm_kernel(X, XS, W, WS, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_xsm, stride_xsk,
                     KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """One output tile per program (pointer loads); with SPLIT_K > 1 program (tile, s) sums every
    SPLIT_K-th K block into an fp32 Y with atomics (small M: more programs than tiles)."""
    BK: tl.constexpr = 128
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(tl.program_id(1), KB, SPLIT_K):
        k = kb * BK + offs_k
        if EVEN_K:
            x_mask = m_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            x_mask = m_ok[:, None] & (k < K)[None, :]
            w_mask = n_ok[None, :] & (k < K)[:, None]
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)     # [BK, BN]
        acc += _promoted_block(x, w, XS, WS, offs_m, offs_n, m_ok, n_ok, kb, stride_xsm, stride_xsk, KB)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, round_to(acc, Y.dtype.element_ty, EMULATE_RNE), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemm_tma_kernel(x_desc, XS, w_desc, WS, y_desc, M, N, stride_xsm, stride_xsk, KB: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                         EMULATE_RNE: tl.constexpr):
    """Persistent: PROGRAMS programs (one per SM) walk the tiles in grouped raster order; x and W
    blocks arrive by TMA (the copy engine fills shared memory, out-of-bounds rows and the K tail
    as zeros), and the finished tile leaves by TMA."""
    BK: tl.constexpr = 128
    tile = tl.program_id(0)
    while tile < tl.cdiv(M, BM) * tl.cdiv(N, BN):
        pid_m, pid_n = grouped_tile(tile, M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(KB):
            x = x_desc.load([pid_m * BM, kb * BK])
            w = w_desc.load([pid_n * BN, kb * BK])                                          # [BN, BK]
            acc += _promoted_block(x, w.T, XS, WS, offs_m, offs_n, offs_m < M, offs_n < N, kb,
                                   stride_xsm, stride_xsk, KB)
        y_desc.store([pid_m * BM, pid_n * BN], round_to(acc, y_desc.dtype, EMULATE_RNE))
        tile += PROGRAMS


def _programs(device: torch.device) -> int:
    """A persistent grid's size: one program per SM (the interpreter: a few)."""
    return sm_count(device, elsewhere=3)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, block_m: int = 128, block_n: int = 128,
             num_warps: int = 8, num_stages: int = 3, split_k: int = 1, tma: bool = False) -> torch.Tensor:
    """y [M, N] = the block-scaled product (fp8_gemm_ref's), in out_dtype. The tile config is an
    argument (the benchmark sweeps it per shape): tma=True runs the persistent TMA kernel (needs
    K % 16 == 0 and N % 8 == 0, TMA's 16-byte row alignment), split_k > 1 splits the K blocks
    over programs that add into an fp32 result."""
    if xq.dtype != FP8 or wq.dtype != FP8 or xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"fp8_gemm: x and w must be float8_e4m3fn [M, K] and [N, K], got {xq.dtype} "
                         f"{tuple(xq.shape)} and {wq.dtype} {tuple(wq.shape)}")
    (m, k), n = xq.shape, wq.shape[0]
    kb = triton.cdiv(k, GROUP)
    for name, t, shape in (("x_scale", x_scale, (m, kb)), ("w_scale", w_scale, (triton.cdiv(n, GROUP), kb))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"fp8_gemm: {name} must be float32 {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    if xq.stride(1) != 1 or wq.stride(1) != 1:
        raise ValueError("fp8_gemm: x and w need contiguous rows")
    if tma and (k % 16 or n % 8 or split_k != 1 or xq.stride(0) != k or wq.stride(0) != k):
        raise ValueError(f"fp8_gemm: the TMA kernel needs K % 16 == 0, N % 8 == 0, packed rows and split_k=1 "
                         f"(got K={k}, N={n}, split_k={split_k})")
    w_scale = w_scale.contiguous()
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=xq.device)
    common = dict(KB=kb, BM=block_m, BN=block_n, GROUP_M=8, EMULATE_RNE=emulate_rne(xq),
                  num_warps=num_warps, num_stages=num_stages)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if tma:
        y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
        programs = min(tiles, _programs(xq.device))
        _fp8_gemm_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(xq, [block_m, GROUP]), x_scale,
            TensorDescriptor.from_tensor(wq, [block_n, GROUP]), w_scale,
            TensorDescriptor.from_tensor(y, [block_m, block_n]), m, n, *x_scale.stride(), PROGRAMS=programs, **common)
        return y
    y = (torch.zeros if split_k > 1 else torch.empty)((m, n), device=xq.device,
                                                      dtype=torch.float32 if split_k > 1 else out_dtype)
    _fp8_gemm_kernel[(tiles, split_k)](xq, x_scale, wq, w_scale, y, m, n, k, xq.stride(0), wq.stride(0),
                                       y.stride(0), *x_scale.stride(), SPLIT_K=split_k, EVEN_K=k % GROUP == 0,
                                       **common)
    return y.to(out_dtype)


def cublas_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same block-scaled product by cuBLAS (torch._scaled_mm with 1 x 128 activation and
    128 x 128 weight scales; CUDA >= 12.9 on Hopper). cuBLAS reads the activation scales M-major
    (quantize_act_fp8's layout) for a token count that is a multiple of 4, and the weight's as
    [K / 128, N / 128]: x is zero-padded to whole groups of four rows here (the padding rows'
    output is dropped). Raises RuntimeError where this torch or GPU has no such path."""
    m = xq.shape[0]
    pad = -m % 4
    if pad:
        xq = torch.cat((xq, torch.zeros((pad, xq.shape[1]), dtype=xq.dtype, device=xq.device)))
        padded = torch.ones((x_scale.shape[1], m + pad), dtype=torch.float32, device=x_scale.device)
        padded[:, :m] = x_scale.t()
        x_scale = padded.t()
    elif x_scale.stride(0) != 1:
        x_scale = x_scale.t().contiguous().t()
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=out_dtype)
    return y[:m] if pad else y
