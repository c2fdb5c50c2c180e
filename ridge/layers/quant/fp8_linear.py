"""`--quantization fp8`: a Linear's weight quantized at load to e4m3 with 128 x 128 block scales
(ridge/layers/quant/fp8.py, DeepSeek-V3's scheme), activations quantized per token and 128
channels at run time, and the product by the fastest block-scaled GEMM for the batch size
(ridge/layers/quant/fp8_dispatch.py). Where the bf16 path measured faster at some batch size, the
layer keeps its bf16 weight for those batches, so FP8 is never slower than bf16 (at the cost of
that layer's bf16 bytes); otherwise only the e4m3 weight and its scales stay.

On a CPU the product is the torch reference of the same arithmetic (quantize_act_fp8_ref,
fp8_gemm_ref), so tests see FP8's numbers without a GPU.

Where the dispatch runs an FP8 kernel for the batch, the kernel that produces the layer's input
can quantize it on its way out (the RMSNorm before QKV and gate-up, the SiLU-and-mul before down:
ridge/kernels/rmsnorm.py, silu_mul.py) and hand over an `Fp8Activation`: the separate quantization
pass, which reads the bf16 activation back and writes it again, disappears. The producer asks the
layer (`takes_fp8(rows)`) per batch; the answer is the dispatch table's for the batch's bucket, so
it is fixed for a captured CUDA graph's batch size, and bf16 batches get bf16 as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ridge.kernels.fp8_gemm import fp8_gemm_ref, quantize_act_fp8_ref
from ridge.layers.cost import Precision, precision_of
from ridge.layers.quant.fp8 import quantize_fp8_block
from ridge.layers.quant.fp8_dispatch import bf16_matmul, bucket_of, dispatch_table, fp8_matmul, quantized_matmul
from ridge.layers.weights import set_weight_loader


@dataclass(frozen=True)
class Fp8Activation:
    """An activation its producer quantized for an FP8 GEMM: e4m3 values [M, K] and fp32 scales
    [M, ceil(K / 128)] (quantize_act_fp8's M-major layout), and the float dtype the activation
    would have had (the GEMM's output dtype)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


# A layer keeps its bf16 weight beside the FP8 one for the batch sizes where bf16 measured faster,
# but only while the model's float weights take at most this share of the device's memory: a 70B
# model on one GPU (141 GB in bf16) cannot hold 80 layers' bf16 copies of qkv, o and down (~60 GB)
# beside its FP8 weights and still have room for a KV cache; it runs FP8 at every batch size.
FLOAT_COPY_MAX_SHARE = 0.5


def keeps_float_copies(float_bytes: int, device: torch.device) -> bool:
    """Whether a model whose projections hold `float_bytes` in float may keep bf16 copies on `device`."""
    if device.type != "cuda":
        return True
    return float_bytes <= FLOAT_COPY_MAX_SHARE * torch.cuda.get_device_properties(device).total_memory


class Fp8Config:
    """The `fp8` quantization setting: block-scaled W8A8 quantized from a float checkpoint at load.
    dummy: the weights are dummy ones (load_format "dummy"), made layer by layer on the device and
    quantized at once; nothing is loaded into a float weight. keep_float: whether a layer may keep
    its bf16 weight for the batch sizes where bf16 measured faster (set by the loader from the
    model's size, keeps_float_copies)."""
    format = "fp8"

    def __init__(self, dummy: bool = False):
        self.dummy, self.keep_float = dummy, True

    def linear_method(self, layer: nn.Module) -> "Fp8Linear":
        return Fp8Linear(layer, float_weight_later=self.dummy, config=self)


class Fp8Linear:
    """A Linear's FP8 weight and how it runs and costs. The float `weight` parameter loads as usual
    (checkpoint or dummy); finish_loading quantizes it and picks the GEMM per batch-size bucket."""
    loads_float_weight = True

    def __init__(self, layer: nn.Module, float_weight_later: bool = False, config: Fp8Config | None = None):
        # Linear leaves the float weight on the meta device; initialize_dummy makes it for real
        self.float_weight_later, self.config = float_weight_later, config
        self.paths: dict[int, str] | None = None       # bucket -> path; None: the CPU reference
        self.float_dtype = torch.bfloat16               # the float weight's, kept for "bf16" buckets
        layer.register_buffer("weight_fp8", None)
        layer.register_buffer("weight_scale_inv", None)

    @torch.no_grad()
    def finish_loading(self, layer) -> None:
        w = layer.weight.data
        self.float_dtype = w.dtype
        layer.weight_fp8, layer.weight_scale_inv = quantize_fp8_block(w)
        if w.is_cuda:
            self.paths = dispatch_table(w, layer.weight_fp8, layer.weight_scale_inv, fed=layer.fp8_producer,
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

    def takes_fp8(self, m: int) -> bool:
        """Whether the GEMM for m rows is an FP8 kernel, which takes an Fp8Activation from the
        producer; the reference (a CPU's torch path) and bf16 batches take the float activation."""
        return self.path(m) not in ("bf16", "reference")

    def apply(self, layer, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] (or an Fp8Activation [M, K]) -> [..., N] (+ bias) by the path measured fastest
        for this many rows."""
        if isinstance(x, Fp8Activation):
            path = self.path(x.q.shape[0])
            if not self.takes_fp8(x.q.shape[0]):
                raise RuntimeError(f"Fp8Linear: a pre-quantized activation of {x.q.shape[0]} rows reached the "
                                   f"{path!r} path, which takes the float activation (ask takes_fp8 first)")
            y = quantized_matmul(path, x.q, x.scale, layer.weight_fp8, layer.weight_scale_inv, x.dtype)
            lead = x.q.shape[:-1]
        else:
            x2 = x.reshape(-1, x.shape[-1])
            path = self.path(x2.shape[0])
            if path == "bf16":
                y = bf16_matmul(x2, layer.weight)
            elif path == "reference":
                y = fp8_gemm_ref(*quantize_act_fp8_ref(x2), layer.weight_fp8, layer.weight_scale_inv, x.dtype)
            else:
                y = fp8_matmul(path, x2.contiguous(), layer.weight_fp8, layer.weight_scale_inv)
            lead = x.shape[:-1]
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, y.shape[-1])

    def precision(self, act: Precision, rows: int) -> Precision:
        """One byte a weight plus an fp32 scale per 128 x 128 block, FP8 tensor-core FLOPs; the bf16
        weight's where the dispatch runs it for this many rows."""
        if self.path(rows) == "bf16":
            return precision_of(self.float_dtype)
        return Precision("fp8-block128", 1 + 4 / 128**2, compute="fp8")
