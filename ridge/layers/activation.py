"""SiLU-and-mul for gated MLPs: input [.., 2*I] = [gate | up] from the merged gate/up GEMM.

A module, so that the projection it feeds owns it (`Linear(..., input_act=SiluAndMul())`): at one
row on CUDA the down projection's GEMV computes it inside its K loop (no activation kernel, no
[1, I] round trip); otherwise it runs here first (ridge/kernels/silu_mul.py, or the torch reference).
Where the down projection runs an FP8 kernel for the batch it asks for `fp8=True`: the kernel
quantizes its output for that GEMM (an Fp8Activation) instead of writing bf16 for a separate
quantization pass; the consumer is a kernel path, so this is too (a CPU reaches it only under
Triton's interpreter, in tests).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_ref
from ridge.layers.cost import FP8_ACT, OpCost, StepShape
from ridge.layers.quant.fp8_linear import Fp8Activation


class SiluAndMul(nn.Module):
    gemv_act = "silu_mul"   # the GEMV's name for this input activation (ridge/kernels/gemv.py)
    fp8_output = True       # forward(x, fp8=True) quantizes for the FP8 GEMM after it

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Activation:
        if fp8:
            return Fp8Activation(*silu_and_mul_fp8(x), x.dtype)
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)

    def cost(self, step: StepShape, width: int, fp8_out: bool = False) -> list[OpCost]:
        """silu(gate) * up over `width` outputs a token: sigmoid (exp, add, divide), two multiplies
        = 5 FLOPs an output (+4 quantizing it, fp8_out); reads [T, 2 * width], writes [T, width]
        (FP8_ACT with fp8_out)."""
        n = step.num_tokens * width
        out = FP8_ACT.bytes if fp8_out else step.act.bytes
        return [OpCost("activation", "elementwise", (5 + 4 * fp8_out) * n, n * (2 * step.act.bytes + out),
                       compute=step.act.compute)]
