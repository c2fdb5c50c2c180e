"""FP8 as a quantization method: `--quantization fp8` (block-scaled W8A8 quantized from a float
checkpoint at load: dense projections by linear.py, experts by experts.py), and an FP8 checkpoint
loaded without it (formats.py: its dense weights dequantized to the model's dtype as they stream
in; its experts in 128 x 128 blocks kept as stored)."""
from __future__ import annotations

import torch
from torch import nn

from ridge.layers.quant.base import ExpertsMethod, LinearMethod, QuantConfig
from ridge.layers.quant.fp8.experts import Fp8AtLoadExperts, Fp8BlockExperts, whole_blocks
from ridge.layers.quant.fp8.formats import Fp8BlockConfig
from ridge.layers.quant.fp8.linear import Fp8Linear

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


def _stored_blocks(checkpoint: Fp8BlockConfig | None, layer: nn.Module) -> bool:
    """Whether an expert layer keeps the checkpoint's FP8 blocks as stored: 128 x 128 blocks (the HF fp8
    format, DeepSeek-V3's; compressed-tensors' block strategy), this rank's share whole blocks of them."""
    return (checkpoint is not None and checkpoint.strategy == "block" and checkpoint.block == (128, 128)
            and whole_blocks(layer))


class Fp8Config(QuantConfig):
    """The `fp8` quantization setting. dummy: the weights are dummy ones (load_format "dummy"), made
    layer by layer on the device and quantized at once. checkpoint: an FP8 checkpoint's weight scheme
    (its experts' blocks are kept, not quantized twice). keep_float: whether a layer may keep its bf16
    weight for the batch sizes where bf16 measured faster (fit_to_device, from the model's size)."""
    name = "fp8"

    def __init__(self, dummy: bool = False, checkpoint: Fp8BlockConfig | None = None):
        self.dummy, self.checkpoint, self.keep_float = dummy, checkpoint, True

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        method = Fp8Linear(layer, float_weight_later=self.dummy, config=self)
        method.create_weights(layer)
        return method

    def experts_method(self, layer: nn.Module) -> ExpertsMethod:
        return Fp8BlockExperts() if _stored_blocks(self.checkpoint, layer) else Fp8AtLoadExperts()

    def fit_to_device(self, float_bytes: int, device: torch.device) -> None:
        self.keep_float = keeps_float_copies(float_bytes, device)


class Fp8CheckpointConfig(QuantConfig):
    """An FP8 checkpoint loaded without `--quantization fp8`: every Linear in the model's dtype (its
    weights dequantized as they load, formats.BlockFp8Reader), the experts' blocks kept where whole."""
    name = "fp8-checkpoint"
    drops_zero_biases = False

    def __init__(self, checkpoint: Fp8BlockConfig):
        self.checkpoint = checkpoint

    def experts_method(self, layer: nn.Module) -> ExpertsMethod | None:
        return Fp8BlockExperts() if _stored_blocks(self.checkpoint, layer) else None
