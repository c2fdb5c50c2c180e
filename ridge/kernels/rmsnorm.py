"""RMSNorm fused with the residual add (Triton). The reference is `rms_norm_ref` below.

    residual_out = x + residual                     (rounded to the input dtype, as torch rounds it)
    out          = weight * to_dtype(residual_out * rsqrt(mean(residual_out^2) + eps))

RMSNorm moves a few bytes per FLOP, so its speed is the bytes it moves. Unfused, the add and the
norm are five or more torch kernels, each re-reading the row from HBM; here x, residual and
weight are read once and the two outputs are written once: 4 row-sized transfers with a
residual, 2 without, which is the minimum.

One program owns ROWS whole rows. A row of hidden 4096 (8 KiB in bf16) fits in the registers
of one program, so the sum of squares is a register/shared-memory reduction with no second
pass over HBM; BLOCK_N is the row length rounded up to a power of two (Triton tiles are powers
of two; the tail is masked). num_warps grows with the tile so each thread keeps roughly 8-16
elements - enough 16-byte vector loads in flight per thread to cover HBM latency, few enough
registers that occupancy stays high. Short rows (Qwen3's per-head q/k norm: [T, H, 128],
normalised over the 128) are packed several to a program so a program still moves a useful
number of bytes and the grid does not become hundreds of thousands of tiny programs.

Inputs may be strided views (q/k split out of the fused QKV GEMM output): every stride is
passed, nothing is copied. A last-dim stride of 1 is specialised to a constant by Triton's
launcher, so the contiguous case still gets vectorised loads. All arithmetic is fp32;
the rounding points are exactly the reference's (see ridge/kernels/rounding.py).

No host synchronisation, no data-dependent Python: the launcher is CUDA-graph capturable.

`rms_norm_fp8` is the same kernel with the output quantized for the FP8 GEMM that reads it (the
QKV / gate-up projections under `--quantization fp8`): the rounded output row is already in
registers, so its per-128-channel scales and e4m3 values cost no pass of their own, and the row
leaves as 1 byte an element plus a scale per 128 instead of 2 bytes (then read back, quantized
and written again by a separate pass). Its reference is rms_norm_ref then quantize_act_fp8_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.fp8_gemm import GROUP, empty_act_fp8, quantize_act_fp8_ref, quantize_groups
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.rounding import emulate_rne, round_to


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, round to x's dtype, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm_fp8's reference: rms_norm_ref, then quantize_act_fp8_ref of its output. Returns
    (e4m3, scales), or ((e4m3, scales), x + residual) with a residual."""
    if residual is None:
        return quantize_act_fp8_ref(rms_norm_ref(x, weight, eps))
    residual = x + residual
    return quantize_act_fp8_ref(rms_norm_ref(residual, weight, eps)), residual


@triton.jit
def _rms_norm_kernel(X, Res, W, Out, ResOut, Scale, n_rows, eps, stride_w,
                     stride_xt, stride_xh, stride_xn, stride_rt, stride_rh, stride_rn,
                     stride_ot, stride_oh, stride_on, stride_st, stride_sh, stride_sn, stride_qst, stride_qsg,
                     HEADS: tl.constexpr, N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, FP8_OUT: tl.constexpr, G: tl.constexpr, EMULATE_RNE: tl.constexpr,
                     PDL: tl.constexpr):
    # row r of the flattened [T * HEADS, N] problem is (token r // HEADS, head r % HEADS);
    # HEADS is a constexpr, so the split is a multiply-shift, and 1 for plain [T, hidden] input
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    tok = (rows // HEADS)[:, None]
    head = (rows % HEADS)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < N)
    pdl_wait(PDL)   # x and the residual come from the kernels before (ridge/kernels/pdl.py)
    x = tl.load(X + tok * stride_xt + head * stride_xh + cols * stride_xn, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + tok * stride_rt + head * stride_rh + cols * stride_rn, mask=mask, other=0.0)
        # torch adds two bf16 tensors in fp32 and rounds once; so do we, and normalise the
        # rounded sum (the value the next layer's residual will hold)
        s = round_to(x.to(tl.float32) + r.to(tl.float32), X.dtype.element_ty, EMULATE_RNE)
        tl.store(ResOut + tok * stride_st + head * stride_sh + cols * stride_sn, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    # masked lanes hold 0 and add nothing; the mean is over the true length N, not BLOCK_N
    # (a multiply by the compile-time 1/N, as torch's CUDA mean does, not an approximate divide)
    mean_sq = tl.sum(xf * xf, axis=1) * (1.0 / N)
    rstd = tl.math.rsqrt(mean_sq + eps)
    normed = round_to(xf * rstd[:, None], X.dtype.element_ty, EMULATE_RNE)
    w = tl.load(W + cols * stride_w, mask=cols < N, other=0.0)
    # weight * normed in the input dtype = one fp32 product rounded once
    y = normed.to(tl.float32) * w.to(tl.float32)
    out_ptrs = Out + tok * stride_ot + head * stride_oh + cols * stride_on
    if FP8_OUT:
        # the output the reference quantizes is rounded to the activation dtype first; the row's
        # masked tail is 0 and leaves its group's amax alone
        y = round_to(y, X.dtype.element_ty, EMULATE_RNE).to(tl.float32)
        q, scale = quantize_groups(tl.reshape(y, (ROWS * (BLOCK_N // G), G)), EMULATE_RNE)
        tl.store(out_ptrs, tl.reshape(q, (ROWS, BLOCK_N)), mask=mask)
        grp = tl.arange(0, BLOCK_N // G)[None, :]
        tl.store(Scale + tok * stride_qst + grp * stride_qsg, tl.reshape(scale, (ROWS, BLOCK_N // G)),
                 mask=(rows < n_rows)[:, None] & (grp * G < N))
    else:
        tl.store(out_ptrs, round_to(y, Out.dtype.element_ty, EMULATE_RNE), mask=mask)


def _as_3d(t: torch.Tensor, name: str) -> torch.Tensor:
    """[T, N] -> [T, 1, N] and [N] -> [1, 1, N] as views (strides kept); [T, H, N] as is."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 3:
        return t
    raise ValueError(f"rms_norm: {name} must be [N], [T, N] or [T, H, N], got shape {tuple(t.shape)}")


def launch_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of n elements."""
    block_n = triton.next_power_of_2(n)
    # ~2K elements per program: a hidden-4096 row is already bigger (1 row per program);
    # head_dim-128 rows go 16 to a program
    rows = max(1, min(16, 2048 // block_n))
    # ~8-16 elements per thread: 4096 -> 8 warps, 8192 -> 16 warps (the most a program can have)
    num_warps = max(1, min(16, rows * block_n // 512))
    return block_n, rows, num_warps


def _check(x: torch.Tensor, weight: torch.Tensor, residual, outputs: dict) -> None:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match last dim {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("rms_norm: residual must have x's shape and dtype")
    for name, t in outputs.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(f"rms_norm: {name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")


def _launch(x, weight, eps, residual, out, residual_out, scale=None):
    """The kernel over x's rows into out (and residual_out); with `scale`, out is e4m3 [T, N] and
    scale its [T, ceil(N / 128)] fp32 scales."""
    n = x.shape[-1]
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, o3 = _as_3d(x, "x"), _as_3d(out, "out")
    r3 = _as_3d(residual, "residual") if residual is not None else x3
    s3 = _as_3d(residual_out, "residual_out") if residual is not None else o3
    tokens, heads = x3.shape[0], x3.shape[1]
    n_rows = tokens * heads
    if n_rows > 0:
        # a quantized row is reshaped into whole 128-channel groups: its tile is at least one group
        block_n, rows, num_warps = launch_config(n if scale is None else max(n, GROUP))
        pdl = use_pdl(x)
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x3, r3, weight, o3, s3, o3 if scale is None else scale, n_rows, eps, weight.stride(0),
            *x3.stride(), *r3.stride(), *o3.stride(), *s3.stride(), *(scale.stride() if scale is not None else (0, 0)),
            HEADS=heads, N=n, HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_N=block_n,
            FP8_OUT=scale is not None, G=GROUP, EMULATE_RNE=emulate_rne(x), PDL=pdl, num_warps=num_warps,
            **launch_options(pdl))
    result = out if scale is None else (out, scale)
    return result if residual is None else (result, residual_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """RMSNorm over the last dim of x ([N], [T, N] or [T, H, N], any strides).

    Without residual returns out; with residual returns (out, residual_out) where
    residual_out = x + residual. out / residual_out may be given (e.g. residual_out=residual for
    an in-place update: each element is read before the same program writes it).
    """
    _check(x, weight, residual, {"out": out, "residual_out": residual_out})
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    return _launch(x, weight, eps, residual, out, residual_out)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None):
    """rms_norm of x [T, N] quantized for an FP8 GEMM in the same kernel: returns (e4m3 [T, N], fp32
    scales [T, ceil(N / 128)]) in quantize_act_fp8's layout, or ((e4m3, scales), residual_out) with
    a residual. x and weight share a dtype: the one the output is rounded to before quantizing."""
    if x.dim() != 2 or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_fp8: x must be [T, N] with weight's dtype, got {x.dtype} {tuple(x.shape)} "
                         f"and weight {weight.dtype}")
    _check(x, weight, residual, {"residual_out": residual_out})
    q, scale = empty_act_fp8(*x.shape, x.device)
    return _launch(x, weight, eps, residual, q, residual_out, scale)
