"""SiLU-and-mul for gated MLPs: input [.., 2*I] = [gate | up] from the merged gate/up GEMM.

A module, so that the projection it feeds owns it (`Linear(..., input_act=SiluAndMul())`): at one
row on CUDA the down projection's GEMV computes it inside its K loop (no activation kernel, no
[1, I] round trip); otherwise it runs here first (ridge/kernels/silu_mul.py, or the torch reference).
Wired to a down projection whose method reads e4m3 activations (ridge/layers/linear.py
wire_producer), it hands it a LinearInput at every batch size; where the projection's GEMM takes
its input quantized for the batch, the kernel quantizes its output for that GEMM instead of
writing bf16 for a separate quantization pass; the consumer is a kernel path, so this is too (a CPU
reaches it only under Triton's interpreter, in tests).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_ref
from ridge.layers.cost import FP8_ACT, OpCost, StepShape
from ridge.layers.quant.base import ACT_E4M3_1X128, LinearInput


class SiluAndMul(nn.Module):
    gemv_act = "silu_mul"   # the GEMV's name for this input activation (ridge/kernels/gemv.py)
    output_formats = (ACT_E4M3_1X128,)      # silu_and_mul_fp8 quantizes the output in the same kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)

    def produce(self, x: torch.Tensor, consumer) -> LinearInput:
        """The output as the consumer takes it for this many rows: quantized in this kernel, or float."""
        if consumer.takes_quantized_input(x.shape[:-1].numel()):
            return LinearInput(x.dtype, quantized=silu_and_mul_fp8(x))
        return LinearInput(x.dtype, float=self(x))

    def cost(self, step: StepShape, width: int, quantized_out: bool = False) -> list[OpCost]:
        """silu(gate) * up over `width` outputs a token: sigmoid (exp, add, divide), two multiplies
        = 5 FLOPs an output (+4 quantizing it, quantized_out); reads [T, 2 * width], writes [T, width]
        (FP8_ACT with quantized_out)."""
        n = step.num_tokens * width
        out = FP8_ACT.bytes if quantized_out else step.act.bytes
        return [OpCost("activation", "elementwise", (5 + 4 * quantized_out) * n, n * (2 * step.act.bytes + out),
                       compute=step.act.compute)]
