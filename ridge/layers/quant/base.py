"""The quantization method interface: what a method is to the layers and the model loader.

A method (vLLM's QuantizationConfig / QuantizeMethodBase, in ridge's terms) is a `QuantConfig`
made by ridge/layers/quant/registry.py from the `quantization` setting and a checkpoint's
quantization_config, handed to the model as it is built. Each Linear asks it for a `LinearMethod`
and each expert layer (ridge/layers/moe.py) for an `ExpertsMethod`; either may answer None (that
layer stays in the model's dtype). The methods create the layer's weights with their
weight_loaders, finish loading, multiply, and state their bytes for the roofline; every question a
layer asks is declared here with its default, so a layer never probes a method for what it can do.

The activation hand-off: a kernel producing a projection's input (an RMSNorm, SiLU-and-mul) can
quantize it on its way out where the projection's GEMM reads a quantized activation, saving the
pass that would read the float activation back. A method declares the activation format it takes
(`input_format`) and, per batch, whether its GEMM takes it (`takes_quantized`); a producer declares
the formats its kernel writes (`output_formats`). The model wires a producer to its consumer once,
at build (ridge/layers/linear.py `wire_producer`), where the two match; from then on the producer
hands that consumer a `LinearInput` at every batch size, float or quantized inside as the consumer
asked, and the consumer runs the path its measured table chose.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from ridge.layers.cost import OpCost, Precision, StepShape

# e4m3 values with an fp32 scale per token and 128 channels (ridge/kernels/fp8_gemm.py quantize_act_fp8)
ACT_E4M3_1X128 = "e4m3-1x128"


@dataclass(frozen=True)
class LinearInput:
    """What a wired producer hands its consumer at every batch size: the float activation [..., K], or
    (where the consumer takes it quantized for this many rows) its quantized values [M, K] and scales
    in the consumer's input_format; dtype is the float activation's (the GEMM's output dtype)."""
    dtype: torch.dtype
    float: torch.Tensor | None = None
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def rows(self) -> int:
        return self.quantized[0].shape[0] if self.float is None else self.float.shape[:-1].numel()


class StoredWeight(ABC):
    """A checkpoint tensor in a stored quantized format (a CheckpointReader's output): loaded into a
    float parameter dequantized, or whole into one whose experts method keeps the stored format (its
    values `q` [N, K] copied in place, the rest by the method's load_stored)."""
    q: torch.Tensor

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float weight the stored values and scales stand for."""


class CheckpointReader:
    """Turns a checkpoint's stream of tensors into what the parameters load: `feed` returns (name,
    tensor or StoredWeight), or None while a tensor waits for its partner (a weight for its scales);
    `finish` checks nothing is left waiting."""

    def feed(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor | StoredWeight] | None:
        return name, tensor

    def finish(self) -> None:
        pass


class LinearMethod(ABC):
    """A Linear's weight storage and GEMM under one method (the Linear passes itself in)."""
    input_format: str | None = None      # the quantized activation its GEMM can take from a producer

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the layer's weight parameters (with their weight_loaders) and buffers."""

    def finish_loading(self, layer: nn.Module) -> None:
        """Once every checkpoint tensor is in (a permutation that needs them all, the path per batch)."""

    @abstractmethod
    def initialize_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Dummy weights (load_format "dummy") in the method's own storage."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias)."""

    def apply_quantized(self, layer: nn.Module, x: LinearInput, bias: torch.Tensor | None) -> torch.Tensor:
        """A producer's quantized activation (input_format) -> [M, N] (+ bias)."""
        raise NotImplementedError(f"{type(self).__name__} takes no quantized activation")

    def takes_quantized(self, rows: int) -> bool:
        """Whether the GEMM for `rows` rows takes its input quantized (input_format) from its producer."""
        return False

    def quantizes_input(self, rows: int) -> bool:
        """Whether the GEMM for `rows` rows reads a quantized activation (its cost: the quantization pass)."""
        return False

    @abstractmethod
    def precision(self, act: Precision, rows: int) -> Precision:
        """The weight's bytes and the FLOPs' kind where this many rows run."""

    def weight_pass(self, layer: nn.Module, step: StepShape, rows: int) -> list[OpCost]:
        """A pass that writes the weight the GEMM reads, before it (none by default)."""
        return []

    def permute_outputs(self, layer: nn.Module, rows: torch.Tensor) -> None:
        """Reorder the output rows (a model's layout change at load), in the method's storage; by
        default the float weight's rows, for a method that quantizes it in finish_loading."""
        layer.weight.data.copy_(layer.weight.data[rows.to(layer.weight.device)])


class ExpertsMethod(ABC):
    """The experts' storage (ridge/layers/moe.py FusedMoE: w13 [E, 2I, H], w2 [E, H, I]) under one method."""
    stores_checkpoint_format = False      # the parameters take a checkpoint's StoredWeights as they are

    def param_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype w13_weight / w2_weight are created in (the float weight's, quantized in finish_loading)."""
        return model_dtype

    def create_weights(self, layer: nn.Module) -> None:
        """Buffers beside w13_weight and w2_weight (a stored format's scales)."""

    def load_stored(self, layer: nn.Module, part: str, expert: int, loaded: StoredWeight) -> None:
        """The scales of a stored weight whose values the layer has just copied into place."""

    @abstractmethod
    def finish_loading(self, layer: nn.Module) -> tuple[object, object]:
        """The kernels' (w13, w2) in this format (ridge/kernels/moe_quant.py); may free the float weights."""

    def initialize_dummy(self, layer: nn.Module, generator: torch.Generator, std: float) -> None:
        """Dummy weights in place, before finish_loading."""
        for w in (layer.w13_weight, layer.w2_weight):
            w.normal_(0.0, std, generator=generator)

    @abstractmethod
    def weight_bytes(self, model_dtype: torch.dtype) -> float:
        """Bytes an expert weight, its share of scales included."""


class ExpertsQuantizedAtLoad(ExpertsMethod):
    """Float experts loaded as usual, quantized once every tensor is in; the float copies go. A method
    names its format's quantizer: `quantize(w [E, N, K]) -> the kernels' experts`."""
    quantize = None

    def finish_loading(self, layer: nn.Module) -> tuple[object, object]:
        quantized = tuple(self.quantize(w.data) for w in (layer.w13_weight, layer.w2_weight))
        for w in (layer.w13_weight, layer.w2_weight):
            w.data = w.data.new_empty(0)
        return quantized


class QuantConfig:
    """One quantization method for a model: the per-layer methods, and what the loader asks of it."""
    name: str = ""
    drops_zero_biases = True      # a checkpoint's all-zero bias of a layer that has none is skipped (AutoGPTQ)

    def linear_method(self, layer: nn.Module) -> LinearMethod | None:
        """The method of a Linear (its weights created on it), or None: it stays in the model's dtype."""
        return None

    def experts_method(self, layer: nn.Module) -> ExpertsMethod | None:
        """The method of an expert layer (None: float experts)."""
        return None

    def fit_to_device(self, float_bytes: int, device: torch.device) -> None:
        """Told the model's float projection bytes before dummy weights are made (a method that could keep
        float copies beside its own decides whether they fit)."""


def compressed_tensors_groups(qc: dict, what: str) -> dict:
    """The config_groups of a compressed-tensors quantization_config, after the checks every
    scheme ridge reads shares (compressed, no sparsity, KV-cache or transform scheme); `what` names
    what ridge reads of the format, for the error."""
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_config.quantization_status: {qc['quantization_status']!r} is not supported "
                         f"(ridge reads compressed checkpoints)")
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise ValueError(f"quantization_config.{key}: is not supported ({what} only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups: is missing or empty")
    return groups
