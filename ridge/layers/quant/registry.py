"""The only place a `quantization` setting (vLLM's --quantization) or a checkpoint's
quantization_config becomes a method: a QuantConfig (ridge/layers/quant/base.py) that the model
loader hands to the model as it is built, and the reader of a checkpoint's stored format.

None reads config.json's quantization_config (none: a float model); "awq", "gptq" and
"compressed-tensors" name the INT4 format the checkpoint must be in; "int4" and "fp8" quantize a
float checkpoint while it loads (int4/, fp8/). An FP8 checkpoint (HF fp8 blocks or compressed-tensors
float-quantized) loads dequantized to the model's dtype, its experts' 128 x 128 blocks kept as
stored; with "fp8" its dense weights are quantized again at load (giving back its own e4m3 values
where its blocks are 128 x 128: each block's maximum is 448 x scale). A new method is a folder
beside int4/ and fp8/ and its line in AT_LOAD or CHECKPOINT_FORMATS below.
"""
from __future__ import annotations

from types import ModuleType

from ridge.layers.quant.base import CheckpointReader, QuantConfig
from ridge.layers.quant.fp8 import formats as fp8_formats
from ridge.layers.quant.fp8.config import Fp8CheckpointConfig, Fp8Config
from ridge.layers.quant.fp8.formats import BlockFp8Reader, fp8_config_of
from ridge.layers.quant.int4 import formats as int4_formats
from ridge.layers.quant.int4.config import AT_LOAD_GROUP, FORMATS, Int4Config

# a setting that quantizes a float checkpoint at load -> its method (dummy: dummy weights, made layer by
# layer; stored: an FP8 checkpoint's weight scheme, whose expert blocks are kept rather than quantized twice)
AT_LOAD = {"int4": lambda dummy, stored: Int4Config("int4", AT_LOAD_GROUP),
           "fp8": lambda dummy, stored: Fp8Config(dummy=dummy, checkpoint=stored)}
# a setting that names the format a quantized checkpoint is in -> its method, from quantization_config
CHECKPOINT_FORMATS = {name: Int4Config.from_hf for name in FORMATS}
QUANTIZATIONS = tuple(CHECKPOINT_FORMATS) + tuple(AT_LOAD)      # the `quantization` setting's values
# a method's checkpoint format, for the tools that write checkpoints (ridge/quantize)
WRITERS = {"int4": int4_formats, "fp8": fp8_formats}
# what the expert kernels run: float experts, or weights quantized at load (or an FP8 checkpoint's blocks)
EXPERT_QUANTIZATIONS = ("int4", "fp8", "fp8-checkpoint")


def select_quantization(setting: str | None, hf_config: dict | None, dummy: bool = False,
                        stored=None) -> QuantConfig | None:
    """The scheme a model loads with, from the `quantization` setting and config.json's quantization_config
    (stored: the FP8 scheme of a checkpoint that loads dequantized, whose quantization_config is not read)."""
    if setting in AT_LOAD:
        if hf_config is not None:
            what = "is" if setting == "fp8" else "is already"
            raise ValueError(f"quantization: {setting!r} quantizes a float checkpoint at load, and this checkpoint "
                             f"{what} quantized (quantization_config.quant_method {hf_config.get('quant_method')!r})"
                             + ("" if setting == "fp8" else "; leave quantization unset to load it as it is"))
        return AT_LOAD[setting](dummy, stored)
    if setting is not None and setting not in CHECKPOINT_FORMATS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}; got {setting!r}")
    if hf_config is None:
        if setting is not None:
            raise ValueError(f"quantization: {setting!r} needs a checkpoint whose config.json has a "
                             f"quantization_config, and this one has none (use 'int4' to quantize at load)")
        return None
    cfg = Int4Config.from_hf(hf_config)
    if setting is not None and setting != cfg.name:
        raise ValueError(f"quantization: {setting!r} does not match the checkpoint's "
                         f"quantization_config.quant_method {hf_config.get('quant_method')!r}")
    return cfg


def quantization_for(setting: str | None, hf_config: dict | None, dummy: bool = False,
                     moe_architecture: str | None = None) -> tuple[QuantConfig | None, CheckpointReader | None]:
    """(the method a model is built with, the reader of its checkpoint's stored format) for the
    `quantization` setting and config.json's quantization_config; moe_architecture: the model's
    architecture where it has experts (their kernels run float, FP8 or INT4 weights quantized at load)."""
    fp8 = fp8_config_of(hf_config)
    if fp8 is not None and setting not in (None, "fp8"):
        raise ValueError(f"quantization: {setting!r} does not apply to this FP8 checkpoint (quantization_config "
                         f"{hf_config.get('quant_method')!r}), which loads dequantized to the model's "
                         f"dtype, or with 'fp8' runs FP8 GEMMs")
    reader = BlockFp8Reader(fp8) if fp8 is not None else None
    if fp8 is not None and setting is None:
        return Fp8CheckpointConfig(fp8), reader
    quant = select_quantization(setting, None if fp8 is not None else hf_config, dummy, fp8)
    if moe_architecture is not None and quant is not None and quant.name not in EXPERT_QUANTIZATIONS:
        raise ValueError(f"quantization: {setting or hf_config.get('quant_method')!r} checkpoints of "
                         f"mixture-of-experts models ({moe_architecture}) are not supported: ridge's expert kernels "
                         f"run float, FP8 or INT4 weights quantized at load from a float checkpoint (quantization "
                         f"'fp8' or 'int4')")
    return quant, reader


def checkpoint_format(method: str) -> ModuleType:
    """The checkpoint format module of a method ("int4": pack and config writers, round to nearest;
    "fp8": the block quantizer and its config), for tools that write quantized checkpoints."""
    return WRITERS[method]
