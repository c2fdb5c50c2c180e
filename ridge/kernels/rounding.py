"""Rounding fp32 results to the storage dtype, the same way on the GPU and in the interpreter.

The fused kernels compute in fp32 registers and round at exactly the points where the torch
reference rounds (a bf16 op in torch is an fp32 op rounded to nearest-even), so their bf16
outputs agree with the reference bit for bit, up to fp32-ulp differences in exp/rsqrt. On the
GPU `.to(tl.bfloat16)` is one cvt.rn instruction. Triton's CPU interpreter instead *truncates*
fp32 -> bf16 (its converter ignores the default rounding mode; its fp32 -> e4m3 converter
mis-rounds values that carry into the next binade), which would make every
interpreter bf16 comparison off by up to an ulp per rounding point. With EMULATE_RNE (set by
the launchers only for CPU tensors, i.e. only under the interpreter) the rounding is done in
integer arithmetic first, so the truncating conversion that follows is exact. Compiled kernels
never see the emulation: EMULATE_RNE is a constexpr and is False for CUDA tensors.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """Round the fp32 tensor x to DTYPE (nearest, ties to even)."""
    if EMULATE_RNE:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            # add just under half a bf16 ulp, plus one if the kept lsb is odd (ties to even),
            # then drop the 16 low bits: the bf16 value is now exact in fp32
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        elif DTYPE == tl.float8e4nv:     # the interpreter's converter mis-rounds values that carry
            x = e4m3_grid(x)                 # into the next binade (124.3 -> 64): round first
    return x.to(DTYPE)


@triton.jit
def e4m3_grid(x):
    """The fp32 tensor x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), as fp32:
    integer arithmetic on the bits, the same on every backend. Converting the result to e4m3 is
    exact, and multiplying it by a scale gives the dequantized value without converting e4m3
    back: the FP8 KV write needs that value too, and Triton 3.6 compiles an fp32 -> e4m3 -> fp32
    round trip inside one kernel wrongly on Hopper (two of every four elements come back as a
    constant pair; tests/kernels/test_rope_kv_fp8.py's GPU check)."""
    bits = x.to(tl.uint32, bitcast=True)
    # keep 3 mantissa bits: add just under half a step, plus one if the kept lsb is odd
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = (x + 24576.0) - 24576.0        # below 2^-6 the e4m3 step is 2^-9: 1.5 x 2^14 rounds to it
    # a negative x that rounds to zero came back +0 from the sum: put its sign back (e4m3 has a
    # -0, and the hardware conversion keeps the sign)
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


def emulate_rne(t) -> bool:
    """Only CPU tensors reach a Triton kernel through the interpreter; CUDA ones are compiled."""
    return t.device.type != "cuda"
