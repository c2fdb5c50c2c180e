"""FP8 experts: e4m3 with a scale per 128 x 128 block (the HF fp8 format's), read by the weight-only
expert kernels, which dequantize tiles in registers (ridge/kernels/moe_quant.py).

Two ways in: quantized at load from float experts (`--quantization fp8`), or an FP8 checkpoint's
experts in 128 x 128 blocks (DeepSeek-V3's) kept as stored, whatever the setting: the parameters
hold e4m3, their loaders take the checkpoint's blocks and scales (Fp8BlockWeight), and the kernels
compute exactly the dequantized model's products. Where a tensor-parallel rank's share of an
expert's intermediate size does not fall on block boundaries the blocks are dequantized at load
instead (fp8/config.py chooses; quantized again under "fp8").
"""
from __future__ import annotations

import torch

from ridge.kernels.moe_quant import FP8_BLOCK, Fp8Experts
from ridge.layers.quant.base import ExpertsMethod, ExpertsQuantizedAtLoad
from ridge.layers.quant.fp8.formats import Fp8BlockWeight, quantize_fp8_block

FP8_EXPERT_BYTES = 1 + 4 / FP8_BLOCK ** 2       # a weight in e4m3 plus its block's fp32 scale


def quantize_experts(w: torch.Tensor) -> Fp8Experts:
    """Float experts [E, N, K] -> e4m3 values and 128 x 128 block scales, expert by expert."""
    q, scale = zip(*(quantize_fp8_block(w[e]) for e in range(w.shape[0])))
    return Fp8Experts(torch.stack(q), torch.stack(scale), w.dtype)


def whole_blocks(layer) -> bool:
    """Whether this rank's share of each expert's intermediate size is whole 128-blocks."""
    return layer.expert_size % FP8_BLOCK == 0 and layer.first % FP8_BLOCK == 0


class Fp8AtLoadExperts(ExpertsQuantizedAtLoad):
    """Float experts quantized to e4m3 128 x 128 blocks once loaded."""
    quantize = staticmethod(quantize_experts)

    def weight_bytes(self, model_dtype: torch.dtype) -> float:
        return FP8_EXPERT_BYTES


class Fp8BlockExperts(ExpertsMethod):
    """The checkpoint's e4m3 blocks and scales, as stored (this rank's whole blocks of them)."""
    stores_checkpoint_format = True

    def param_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn

    def create_weights(self, layer) -> None:
        E, h, inter = layer.num_experts, -(-layer.hidden_size // FP8_BLOCK), layer.expert_size // FP8_BLOCK
        layer.register_buffer("w13_scale", torch.ones(E, 2 * inter, h, dtype=torch.float32))
        layer.register_buffer("w2_scale", torch.ones(E, h, inter, dtype=torch.float32))

    def load_stored(self, layer, part: str, expert: int, loaded: Fp8BlockWeight) -> None:
        """The scales of this rank's whole blocks, at the place its values went (part: "gate", "up", or
        "" for down)."""
        inter, b = layer.expert_size // FP8_BLOCK, FP8_BLOCK
        scale = (layer.w13_scale if part else layer.w2_scale)[expert]
        if part:
            scale = scale.narrow(0, 0 if part == "gate" else inter, inter)
        scale.copy_(loaded.scale.narrow(0 if part else 1, layer.first // b, inter))

    def finish_loading(self, layer) -> tuple[Fp8Experts, Fp8Experts]:
        return tuple(Fp8Experts(w.data, s, layer.dtype) for w, s in
                     ((layer.w13_weight, layer.w13_scale), (layer.w2_weight, layer.w2_scale)))

    def initialize_dummy(self, layer, generator: torch.Generator, std: float) -> None:
        """Random float experts in the checkpoint's blocks."""
        for w, scale in ((layer.w13_weight, layer.w13_scale), (layer.w2_weight, layer.w2_scale)):
            f = torch.empty(w.shape, dtype=layer.dtype, device=w.device).normal_(0.0, std, generator=generator)
            q = quantize_experts(f)
            w.data.copy_(q.q)
            scale.copy_(q.scale)

    def weight_bytes(self, model_dtype: torch.dtype) -> float:
        return FP8_EXPERT_BYTES
