"""RMSNorm, with the residual add folded in.

`forward(x, residual)` returns `(norm(x + residual), x + residual)`: the decoder's two "add
residual, then normalise" points become one call, which the fused Triton kernel
(ridge/kernels/rmsnorm.py) serves with one read of x and residual and one write of each output.
The arithmetic follows transformers (normalise in float32, scale in the input dtype) so float32
logits match it to rounding; the kernel rounds at the same points.

A norm wired to the projection reading its output (the decoder's norms before QKV and gate-up,
ridge/layers/linear.py wire_producer: where the projection's method reads e4m3 activations) hands
it a LinearInput at every batch size, and asks it per batch whether its GEMM takes the input
quantized; if so the kernel quantizes the output for it on the way out (rms_norm_fp8: 1 byte an
element plus a scale per 128 channels, in place of the bf16 row a separate quantization pass would
read back). The consumer is a kernel path, so this is too (a CPU reaches it only under Triton's
interpreter, in tests).
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.rmsnorm import rms_norm, rms_norm_fp8, rms_norm_ref
from ridge.layers.cost import FP8_ACT, OpCost, StepShape
from ridge.layers.linear import Linear
from ridge.layers.quant.base import ACT_E4M3_1X128, LinearInput
from ridge.layers.weights import set_weight_loader


class RMSNorm(nn.Module):
    output_formats = (ACT_E4M3_1X128,)      # rms_norm_fp8 quantizes the output in the same kernel
    consumer: Linear | None = None          # the projection wired to read the output (wire_producer)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(nn.Parameter(torch.empty(dim), requires_grad=False))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.consumer is not None:
            return self.produce(x, self.consumer, residual)
        return self._norm(x, residual)

    def produce(self, x: torch.Tensor, consumer: Linear, residual: torch.Tensor | None = None):
        """The output as the consumer takes it for this many rows: quantized by the norm's own kernel,
        or the float row (as forward, with the residual sum beside it)."""
        if consumer.takes_quantized_input(x.shape[:-1].numel()):
            out = rms_norm_fp8(x, self.weight, self.eps, residual)
            if residual is None:
                return LinearInput(x.dtype, quantized=out)
            return LinearInput(x.dtype, quantized=out[0]), out[1]
        out = self._norm(x, residual)
        return LinearInput(x.dtype, float=out) if residual is None else (LinearInput(x.dtype, float=out[0]), out[1])

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def cost(self, step: StepShape, rows: int | None = None, residual: bool = False,
             residual_out: bool = True) -> list[OpCost]:
        """x*x, accumulate, scale by 1/rms, by the weight: 4 FLOPs an element, +1 for the residual
        add, +4 quantizing for the projection it feeds; reads x (and the residual), writes the
        output (FP8_ACT where it quantizes) and the sum, unless never read."""
        rows = step.num_tokens if rows is None else rows
        n, params = rows * self.weight.shape[0], self.weight.nbytes
        quantized = self.consumer is not None and self.consumer.fed_quantized_at(step, rows)
        moved = 1 + (1 + residual_out if residual else 0)
        out = FP8_ACT.bytes if quantized else step.act.bytes
        return [OpCost("norm", "elementwise", (4 + residual + 4 * quantized) * n,
                       n * (moved * step.act.bytes + out) + params,
                       params, compute=step.act.compute)]
