"""FP8 weights in the block-scaled layout DeepSeek-V3 and the Qwen3-*-FP8 checkpoints ship, which
transformers' FineGrainedFP8 and vLLM read (config.json `quantization_config`: `quant_method: fp8`,
`fmt: e4m3`, `activation_scheme: dynamic`, `weight_block_size: [bn, bk]`, optionally
`scale_fmt: ue8m0`). For a Linear with N outputs and K inputs:
  weight            float8_e4m3fn [N, K]
  weight_scale_inv  [ceil(N / bn), ceil(K / bk)]: fp32, or powers of two (fp32 or float8_e8m0fnu)
                    under ue8m0
  W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]
A 128 x 128 block shares one scale, so a block-scaled GEMM applies it once per K block of 128 to
its fp32 partial sum (DeepSeek-V3's promotion) instead of once per weight; ue8m0 scales are exact
exponent shifts. The last blocks of a ragged N or K cover what is left. compressed-tensors
`float-quantized` (llm-compressor's FP8) is the same arithmetic with `weight_scale` per block, per
output channel or per tensor.

This module is the format: quantizing a float weight the way those checkpoints were made (per
block, amax / 448, e4m3 saturating), dequantizing, reading the config and checking a checkpoint's
tensors, with errors that name the field or the tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ridge.kernels.fp8_gemm import FP8, FP8_MAX, as_blocks
from ridge.layers.quant.base import CheckpointReader, StoredWeight, compressed_tensors_groups

UE8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass(frozen=True)
class Fp8BlockConfig:
    """One FP8 weight scheme for every projection. block: rows x columns sharing a scale (strategy
    "block"); "channel" is one scale per output row, "tensor" one per weight. scale_name: the scale
    tensor's name and meaning, W = weight x scale either way ("weight_scale_inv" in HF fp8
    checkpoints, "weight_scale" in compressed-tensors'). ue8m0: the scales are powers of two."""
    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False
    strategy: str = "block"
    scale_name: str = "weight_scale_inv"

    @classmethod
    def from_hf(cls, qc: dict) -> "Fp8BlockConfig":
        """config.json's quantization_config of an HF "fp8" checkpoint; an unsupported value names its field."""
        if qc.get("quant_method") != "fp8":
            raise ValueError(f"quantization_config.quant_method: expected 'fp8', got {qc.get('quant_method')!r}")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt: {qc['fmt']!r} is not supported (e4m3 only)")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme: {qc['activation_scheme']!r} is not supported "
                             f"(dynamic: activations are scaled per token and block at run time)")
        block = _block(qc.get("weight_block_size"), "quantization_config.weight_block_size")
        fmt = qc.get("scale_fmt")
        if fmt not in (None, "float", "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt: {fmt!r} is not supported (float or ue8m0)")
        return cls(block, fmt == "ue8m0")

    @classmethod
    def from_compressed_tensors(cls, qc: dict) -> "Fp8BlockConfig":
        """A compressed-tensors `float-quantized` quantization_config (llm-compressor's FP8: per-tensor,
        per-channel or block weight scales; activation schemes are what FP8 compute would use and do
        not change the weights)."""
        schemes = set()
        for name, group in compressed_tensors_groups(qc, "FP8 weights").items():
            field = f"quantization_config.config_groups.{name}.weights"
            w = group.get("weights") or {}
            if w.get("num_bits") != 8 or w.get("type") != "float":
                raise ValueError(f"{field}: expected num_bits 8 and type 'float' (e4m3), got "
                                 f"{w.get('num_bits')!r} and {w.get('type')!r}")
            if not w.get("symmetric", True) or w.get("dynamic"):
                raise ValueError(f"{field}: asymmetric or dynamic weight scales are not supported")
            strategy = w.get("strategy")
            if strategy not in ("tensor", "channel", "block"):
                raise ValueError(f"{field}.strategy: {strategy!r} is not supported (tensor, channel or block)")
            block = _block(w.get("block_structure"), f"{field}.block_structure") if strategy == "block" else None
            schemes.add((strategy, block))
        if len(schemes) > 1:
            raise ValueError("quantization_config.config_groups: groups with different weight schemes are not supported")
        strategy, block = schemes.pop()
        return cls(block, False, strategy, "weight_scale")

    def to_hf(self) -> dict:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(self.block)}
        return {**qc, "scale_fmt": "ue8m0"} if self.ue8m0 else qc

    def block_for(self, n: int, k: int) -> tuple[int, int]:
        return {"block": self.block, "channel": (1, k), "tensor": (n, k)}[self.strategy]

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        bn, bk = self.block_for(n, k)
        return math.ceil(n / bn), math.ceil(k / bk)


WRITTEN_SCHEME = Fp8BlockConfig()      # what `ridge quantize --method fp8` writes: 128 x 128 blocks, fp32 scales


def fp8_config_of(qc) -> Fp8BlockConfig | None:
    """The FP8 weight scheme of a checkpoint's quantization_config (HF fp8 or compressed-tensors
    float-quantized), or None when it is not an FP8 one."""
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return Fp8BlockConfig.from_hf(qc)
    formats = {qc.get("format"), *(g.get("format") for g in (qc.get("config_groups") or {}).values())}
    if method == "compressed-tensors" and "float-quantized" in formats:
        return Fp8BlockConfig.from_compressed_tensors(qc)
    return None


def _block(block, field: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{field}: expected two positive integers [rows, columns], got {block!r}")
    return tuple(block)


def quantize_fp8_block(w: torch.Tensor, config: Fp8BlockConfig = Fp8BlockConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (weight float8_e4m3fn [N, K], weight_scale_inv fp32), as the
    checkpoints' writers compute them: per block, scale = 448 / amax (1 for an all-zero block),
    scale_inv = 1 / scale (ue8m0: rounded up to a power of two, so no value saturates), weight =
    w x scale rounded to e4m3."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_block: expected a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    b = as_blocks(w.float(), config.block_for(n, k))
    amax = b.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))    # transformers' arithmetic, bit for bit
    scale_inv = 1.0 / scale
    if config.ue8m0:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
        scale = 1.0 / scale_inv
    q = (b * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(b.shape[0] * b.shape[1], b.shape[2] * b.shape[3])[:n, :k].contiguous()
    return q, scale_inv


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] and weight_scale_inv -> W [N, K] in dtype (computed in fp32)."""
    n, k = q.shape
    b = as_blocks(q.float(), block)
    w = b * scale_inv.float()[:, None, :, None]
    return w.reshape(b.shape[0] * b.shape[1], b.shape[2] * b.shape[3])[:n, :k].to(dtype)


def check_fp8_tensors(name: str, weight: torch.Tensor, scale: torch.Tensor, n: int, k: int,
                      config: Fp8BlockConfig) -> torch.Tensor:
    """A checkpoint's pair for a Linear of n outputs and k inputs, the error naming the tensor;
    returns the scales as the [N / bn, K / bk] grid (a channel scale [N] or [N, 1], a tensor scale
    [], [1] or [1, 1])."""
    if weight.dtype != FP8 or tuple(weight.shape) != (n, k):
        raise ValueError(f"{name}.weight: expected float8_e4m3fn [{n}, {k}], got {weight.dtype} {tuple(weight.shape)}")
    expected = config.scale_shape(n, k)
    allowed = (torch.float32, torch.bfloat16, torch.float16) + ((UE8M0,) if UE8M0 is not None else ())
    if scale.dtype not in allowed or scale.numel() != expected[0] * expected[1] or (
            config.strategy == "block" and tuple(scale.shape) != expected):
        what = {"block": f"blocks of {config.block[0]} x {config.block[1]}", "channel": "one per output",
                "tensor": "one per weight"}[config.strategy]
        raise ValueError(f"{name}.{config.scale_name}: expected float32 {list(expected)} ({what}), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    s = scale.float().reshape(expected)
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"{name}.{config.scale_name}: every scale must be finite and positive")
    if config.ue8m0 and not bool((torch.exp2(torch.round(torch.log2(s))) == s).all()):
        raise ValueError(f"{name}.{config.scale_name}: scale_fmt ue8m0 needs powers of two")
    return s


@dataclass(frozen=True)
class Fp8BlockWeight(StoredWeight):
    """A checkpoint's FP8 weight as stored: e4m3 values [N, K], its scale grid (check_fp8_tensors'),
    and the block a scale covers. A parameter that keeps the stored format (`takes_stored`: the FP8
    block experts, whose kernels read them) takes it whole; every other one its dequantization."""
    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8_block(self.q, self.scale, self.block)


class BlockFp8Reader(CheckpointReader):
    """Pairs each FP8 `X.weight` with its scale tensor (`X.weight_scale_inv` or `X.weight_scale`,
    per the config) as a checkpoint streams by (either may come first, or in another shard) and
    hands on `X.weight` as an Fp8BlockWeight, checked (the loader dequantizes it to the model's dtype
    unless its parameter keeps FP8 blocks); activation scales (`X.input_scale`) are dropped, every
    other tensor passes through."""

    def __init__(self, config: Fp8BlockConfig):
        self.config, self.pending = config, {}
        self.suffix = "." + config.scale_name

    def feed(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor | Fp8BlockWeight] | None:
        if name.endswith(".input_scale"):
            return None
        if name.endswith(self.suffix):
            base = name[:-len(self.suffix)] + ".weight"
        elif name.endswith(".weight") and tensor.dtype == FP8:
            base = name
        else:
            return name, tensor
        other = self.pending.pop(base, None)
        if other is None:
            self.pending[base] = tensor
            return None
        weight, scale = (tensor, other) if name == base else (other, tensor)
        if weight.dim() != 2:
            raise ValueError(f"{base}: expected float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
        prefix = base[:-len(".weight")]
        grid = check_fp8_tensors(prefix, weight, scale, *weight.shape, self.config)
        return base, Fp8BlockWeight(weight, grid, self.config.block_for(*weight.shape))

    def finish(self) -> None:
        """Every FP8 weight found its scales, and every scale its weight."""
        for base, tensor in self.pending.items():
            scale = base[:-len(".weight")] + self.suffix
            missing, present = ((scale, base) if tensor.dtype == FP8 else (f"{base} (float8_e4m3fn)", scale))
            raise ValueError(f"checkpoint tensor {present!r} has no {missing!r}")
