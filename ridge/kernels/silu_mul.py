"""SiLU-and-mul for the gated MLP (Triton). The reference is `silu_and_mul_ref` below.

    x = [gate | up]  ([T, 2I], the merged gate/up GEMM output)  ->  silu(gate) * up  ([T, I])

Pure streaming: 2 reads and 1 write per output element, a handful of FLOPs. In torch it is a
chunk, a silu kernel (read gate, write a [T, I] temporary) and a mul kernel (read it back with
up, write the result): 5 transfers instead of 3. Fused, the temporary never leaves registers.

The grid is (token, block of I): each program streams BLOCK contiguous elements of gate and the
matching BLOCK of up from one row, so every load is a wide coalesced vector load and no program
needs more than a few registers per thread. Tokens go on grid axis 0 (up to 2^31 - 1 programs)
because axis 1 is capped at 65535 and T can be a large prefill batch. BLOCK shrinks when T is
small so that a decode step (T = 1, I = 14336) still spreads over ~100 programs and many SMs
instead of 14 - at that size the kernel is latency-bound and parallelism is what there is to buy.

silu is evaluated in fp32; the result is rounded to the input dtype before the product, then the
product is rounded once - the same two rounding points as F.silu(gate) * up in bf16.
Any row/column strides are accepted (no copies); CUDA-graph capturable (no host syncs).

`silu_and_mul_fp8` is the same kernel with the product quantized for the FP8 down projection
that reads it: each program's BLOCK (a multiple of 128) is whole 128-channel groups of one token,
so the scales come from registers and the [T, I] result leaves as 1 byte an element plus a scale
per 128 instead of 2 bytes, with no separate quantization pass. Its reference is
silu_and_mul_ref then quantize_act_fp8_ref.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ridge.kernels.fp8_gemm import GROUP, empty_act_fp8, quantize_act_fp8_ref, quantize_groups
from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl
from ridge.kernels.rounding import emulate_rne, round_to

_MIN_PROGRAMS = 256   # about two programs per SM on an H100 (132 SMs)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_fp8's reference: silu_and_mul_ref, then quantize_act_fp8_ref."""
    return quantize_act_fp8_ref(silu_and_mul_ref(x))


@triton.jit
def silu_times(g, u, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """silu(g) * u in fp32 from fp32 g and u, silu rounded to DTYPE before the product: the
    reference's rounding points (the caller rounds the product once). Shared by every kernel
    that fuses this activation (here, the GEMV's K loop, the MoE expert kernels' epilogues)."""
    # exp(-g) overflows to inf for g < -88 and g / inf = -0: the correct limit, no NaN. The
    # IEEE division (div.rn, as torch's silu uses) costs a few more instructions than Triton's
    # default div.full, which the memory-bound kernels hide, and keeps bf16 results bitwise equal
    # to the reference far more often.
    act = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DTYPE, EMULATE_RNE)
    return act.to(tl.float32) * u


@triton.jit
def silu_mul_sums(g, u, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """silu(g) * u in DTYPE from a GEMM's fp32 sums g and u: each sum rounded to DTYPE first, as the
    reference's GEMM outputs are, then silu_times and the product rounded once."""
    g = round_to(g, DTYPE, EMULATE_RNE).to(tl.float32)
    u = round_to(u, DTYPE, EMULATE_RNE).to(tl.float32)
    return round_to(silu_times(g, u, DTYPE, EMULATE_RNE), DTYPE, EMULATE_RNE)


@triton.jit
def _silu_and_mul_kernel(X, Out, Scale, inter, stride_xt, stride_xi, stride_ot, stride_oi, stride_st, stride_sg,
                         BLOCK: tl.constexpr, FP8_OUT: tl.constexpr, G: tl.constexpr, EMULATE_RNE: tl.constexpr,
                         PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = X + tok * stride_xt
    pdl_wait(PDL)   # x is the gate/up GEMM's output (ridge/kernels/pdl.py)
    g = tl.load(row + cols * stride_xi, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + (cols + inter) * stride_xi, mask=mask, other=0.0).to(tl.float32)
    y = silu_times(g, u, X.dtype.element_ty, EMULATE_RNE)
    out_ptrs = Out + tok * stride_ot + cols * stride_oi
    if FP8_OUT:
        # rounded to the activation dtype first, as the reference's product is; masked lanes are
        # silu(0) * 0 = 0 and leave the last group's amax alone
        y = round_to(y, X.dtype.element_ty, EMULATE_RNE).to(tl.float32)
        q, scale = quantize_groups(tl.reshape(y, (BLOCK // G, G)), EMULATE_RNE)
        tl.store(out_ptrs, tl.reshape(q, (BLOCK,)), mask=mask)
        grp = tl.program_id(1) * (BLOCK // G) + tl.arange(0, BLOCK // G)
        tl.store(Scale + tok * stride_st + grp * stride_sg, scale, mask=grp * G < inter)
    else:
        tl.store(out_ptrs, round_to(y, Out.dtype.element_ty, EMULATE_RNE), mask=mask)


def launch_config(tokens: int, inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps). 1024 elements x 4 warps = 8 per thread per tensor: a 16-byte load each
    for bf16. Halve BLOCK (down to 128) while the grid would have fewer than _MIN_PROGRAMS."""
    block = min(1024, triton.next_power_of_2(inter))
    while block > 128 and tokens * triton.cdiv(inter, block) < _MIN_PROGRAMS:
        block //= 2
    return block, max(1, min(4, block // 256))


def _launch(x2: torch.Tensor, o2: torch.Tensor, inter: int, scale: torch.Tensor | None = None) -> None:
    """The kernel over x2 [T, 2I] into o2 [T, I]; with `scale`, o2 is e4m3 and scale its fp32
    [T, ceil(I / 128)] scales."""
    tokens = x2.shape[0]
    if tokens == 0 or inter == 0:
        return
    block, num_warps = launch_config(tokens, inter)
    if scale is not None:
        block = max(block, GROUP)        # a program quantizes whole 128-channel groups
    pdl = use_pdl(x2)
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        x2, o2, o2 if scale is None else scale, inter, x2.stride(0), x2.stride(1), o2.stride(0), o2.stride(1),
        *(scale.stride() if scale is not None else (0, 0)), BLOCK=block, FP8_OUT=scale is not None, G=GROUP,
        EMULATE_RNE=emulate_rne(x2), PDL=pdl, num_warps=num_warps, **launch_options(pdl))


def _check_gate_up(x: torch.Tensor, name: str) -> int:
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dim must be even (gate | up), got {x.shape[-1]}")
    return x.shape[-1] // 2


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] or [2I] (any strides) -> silu(x[..., :I]) * x[..., I:], [T, I] (or [I])."""
    inter = _check_gate_up(x, "silu_and_mul")
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], inter):
        raise ValueError(f"silu_and_mul: out must have shape {(*x.shape[:-1], inter)}, got {tuple(out.shape)}")
    # leading dims become one token dim as a view (view() raises rather than copying)
    x2 = x.view(1, -1) if x.dim() == 1 else x.view(-1, x.shape[-1]) if x.dim() > 2 else x
    o2 = out.view(1, -1) if out.dim() == 1 else out.view(-1, inter) if out.dim() > 2 else out
    _launch(x2, o2, inter)
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2I] (any strides) -> silu_and_mul(x) quantized for an FP8 GEMM in the same kernel:
    (e4m3 [T, I], fp32 scales [T, ceil(I / 128)]) in quantize_act_fp8's layout."""
    if x.dim() != 2:
        raise ValueError(f"silu_and_mul_fp8: x must be [T, 2I], got shape {tuple(x.shape)}")
    inter = _check_gate_up(x, "silu_and_mul_fp8")
    q, scale = empty_act_fp8(x.shape[0], inter, x.device)
    _launch(x, q, inter, scale)
    return q, scale
