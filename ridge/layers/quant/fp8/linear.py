"""`--quantization fp8`: a Linear's weight quantized at load to e4m3 with 128 x 128 block scales
(ridge/layers/quant/fp8/formats.py, DeepSeek-V3's scheme), activations quantized per token and 128
channels at run time, and the product by the fastest block-scaled GEMM for the batch size
(ridge/layers/quant/fp8/dispatch.py). Where the bf16 path measured faster at some batch size, the
layer keeps its bf16 weight for those batches, so FP8 is never slower than bf16 (at the cost of
that layer's bf16 bytes); otherwise only the e4m3 weight and its scales stay.

On a CPU the product is the torch reference of the same arithmetic (quantize_act_fp8_ref,
fp8_gemm_ref), so tests see FP8's numbers without a GPU.

Where the dispatch runs an FP8 kernel for the batch, the kernel that produces the layer's input
can quantize it on its way out (the RMSNorm before QKV and gate-up, the SiLU-and-mul before down:
ridge/kernels/rmsnorm.py, silu_mul.py: the model wires them, ridge/layers/quant/base.py) and hand
over the e4m3 values and scales in a LinearInput: the separate quantization pass, which reads the
bf16 activation back and writes it again, disappears. The producer asks the layer
(`takes_quantized(rows)`) per batch; the answer is the dispatch table's for the batch's bucket, so
it is fixed for a captured CUDA graph's batch size, and bf16 batches get bf16 as before.
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.fp8_gemm import fp8_gemm_ref, quantize_act_fp8_ref
from ridge.layers.cost import Precision, precision_of
from ridge.layers.quant.base import ACT_E4M3_1X128, LinearInput, LinearMethod
from ridge.layers.quant.fp8.dispatch import bf16_matmul, bucket_of, dispatch_table, fp8_matmul, quantized_matmul
from ridge.layers.quant.fp8.formats import quantize_fp8_block
from ridge.layers.weights import set_weight_loader


class Fp8Linear(LinearMethod):
    """A Linear's FP8 weight and how it runs and costs. The float `weight` parameter loads as usual
    (checkpoint or dummy); finish_loading quantizes it and picks the GEMM per batch-size bucket.
    float_weight_later: the weights are dummy ones, made layer by layer on the device and quantized
    at once (nothing is loaded into a float weight); config.keep_float: whether the layer may keep its
    bf16 weight for the batch sizes where bf16 measured faster (fp8/config.py)."""
    input_format = ACT_E4M3_1X128

    def __init__(self, layer: nn.Module | None = None, float_weight_later: bool = False, config=None):
        self.float_weight_later, self.config = float_weight_later, config
        self.paths: dict[int, str] | None = None       # bucket -> path; None: the CPU reference
        self.float_dtype = torch.bfloat16               # the float weight's, kept for "bf16" buckets

    def create_weights(self, layer: nn.Module) -> None:
        # with dummy weights the float weight is only a shape (meta) until its layer's turn, so a model
        # whose float weights outgrow the device (70B in bf16 on one GPU) never holds more than one
        # layer's of them (initialize_dummy)
        layer.weight = layer.float_weight("meta" if self.float_weight_later else None)
        layer.register_buffer("weight_fp8", None)
        layer.register_buffer("weight_scale_inv", None)

    @torch.no_grad()
    def finish_loading(self, layer) -> None:
        w = layer.weight.data
        self.float_dtype = w.dtype
        layer.weight_fp8, layer.weight_scale_inv = quantize_fp8_block(w)
        if w.is_cuda:
            self.paths = dispatch_table(w, layer.weight_fp8, layer.weight_scale_inv, fed=layer.fed_quantized,
                                        allow_bf16=self.config is None or self.config.keep_float)
        if self.paths is None or "bf16" not in self.paths.values():
            layer.weight = None                           # only the FP8 weight is ever read: free the bf16 one

    def initialize_dummy(self, layer, generator: torch.Generator, std: float) -> None:
        """normal(0, std) float weights quantized at once. A meta weight (float_weight_later) is made
        here, on the generator's device: one layer's float weight at a time exists, then goes
        (unless the dispatch keeps it for a bf16 bucket)."""
        w = layer.weight
        if w.is_meta:
            layer.weight = set_weight_loader(
                nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=generator.device), requires_grad=False),
                w.weight_loader, w.shard_ids)
        layer.weight.normal_(0.0, std, generator=generator)
        self.finish_loading(layer)

    def path(self, m: int) -> str:
        return "reference" if self.paths is None else self.paths[bucket_of(m)]

    def quantizes_input(self, m: int) -> bool:
        """Whether the GEMM for m rows reads FP8 activations (every path but the bf16 one)."""
        return self.path(m) != "bf16"

    def takes_quantized(self, m: int) -> bool:
        """Whether the GEMM for m rows is an FP8 kernel, which takes the e4m3 activation from its
        producer; the reference (a CPU's torch path) and bf16 batches take the float activation."""
        return self.path(m) not in ("bf16", "reference")

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias) by the path measured fastest for this many rows."""
        x2 = x.reshape(-1, x.shape[-1])
        path = self.path(x2.shape[0])
        if path == "bf16":
            y = bf16_matmul(x2, layer.weight)
        elif path == "reference":
            y = fp8_gemm_ref(*quantize_act_fp8_ref(x2), layer.weight_fp8, layer.weight_scale_inv, x.dtype)
        else:
            y = fp8_matmul(path, x2.contiguous(), layer.weight_fp8, layer.weight_scale_inv)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def apply_quantized(self, layer, x: LinearInput, bias: torch.Tensor | None) -> torch.Tensor:
        """The producer's e4m3 values [M, K] and scales (quantize_act_fp8's layout) -> [M, N] (+ bias)."""
        q, scale = x.quantized
        path = self.path(q.shape[0])
        if not self.takes_quantized(q.shape[0]):
            raise RuntimeError(f"Fp8Linear: a pre-quantized activation of {q.shape[0]} rows reached the "
                               f"{path!r} path, which takes the float activation (ask takes_quantized first)")
        y = quantized_matmul(path, q, scale, layer.weight_fp8, layer.weight_scale_inv, x.dtype)
        return y + bias if bias is not None else y

    def precision(self, act: Precision, rows: int) -> Precision:
        """One byte a weight plus an fp32 scale per 128 x 128 block, FP8 tensor-core FLOPs; the bf16
        weight's where the dispatch runs it for this many rows."""
        if self.path(rows) == "bf16":
            return precision_of(self.float_dtype)
        return Precision("fp8-block128", 1 + 4 / 128**2, compute="fp8")
