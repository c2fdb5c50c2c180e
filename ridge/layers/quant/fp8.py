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
exponent shifts. The last blocks of a ragged N or K cover what is left.

This module is the format: quantizing a float weight the way those checkpoints were made (per
block, amax / 448, e4m3 saturating), dequantizing, reading the config and checking a checkpoint's
tensors, with errors that name the field or the tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                      # the largest finite e4m3fn value
UE8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass(frozen=True)
class Fp8BlockConfig:
    """One block size for every projection; ue8m0: the scales are powers of two."""
    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False

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
        block = qc.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size: expected two positive integers "
                             f"[rows, columns], got {block!r}")
        fmt = qc.get("scale_fmt")
        if fmt not in (None, "float", "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt: {fmt!r} is not supported (float or ue8m0)")
        return cls(tuple(block), fmt == "ue8m0")

    def to_hf(self) -> dict:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(self.block)}
        return {**qc, "scale_fmt": "ue8m0"} if self.ue8m0 else qc

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        return math.ceil(n / self.block[0]), math.ceil(k / self.block[1])


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [N / bn, bn, K / bk, bk], zero-padded to whole blocks."""
    (n, k), (bn, bk) = w.shape, block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        w = torch.nn.functional.pad(w, (0, pk, 0, pn))
    return w.reshape((n + pn) // bn, bn, (k + pk) // bk, bk)


def quantize_fp8_block(w: torch.Tensor, config: Fp8BlockConfig = Fp8BlockConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (weight float8_e4m3fn [N, K], weight_scale_inv fp32), as the
    checkpoints' writers compute them: per block, scale = 448 / amax (1 for an all-zero block),
    scale_inv = 1 / scale (ue8m0: rounded up to a power of two, so no value saturates), weight =
    w x scale rounded to e4m3."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_block: expected a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    b = _blocks(w.float(), config.block)
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
    b = _blocks(q.float(), block)
    w = b * scale_inv.float()[:, None, :, None]
    return w.reshape(b.shape[0] * b.shape[1], b.shape[2] * b.shape[3])[:n, :k].to(dtype)


def check_fp8_tensors(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, n: int, k: int,
                      config: Fp8BlockConfig) -> None:
    """A checkpoint's pair for a Linear of n outputs and k inputs; the error names the tensor."""
    if weight.dtype != FP8 or tuple(weight.shape) != (n, k):
        raise ValueError(f"{name}.weight: expected float8_e4m3fn [{n}, {k}], got {weight.dtype} {tuple(weight.shape)}")
    expected = config.scale_shape(n, k)
    allowed = (torch.float32, torch.bfloat16) + ((UE8M0,) if UE8M0 is not None else ())
    if scale_inv.dtype not in allowed or tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}.weight_scale_inv: expected float32 {list(expected)} (blocks of "
                         f"{config.block[0]} x {config.block[1]}), got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    s = scale_inv.float()
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"{name}.weight_scale_inv: every scale must be finite and positive")
    if config.ue8m0 and not bool((torch.exp2(torch.round(torch.log2(s))) == s).all()):
        raise ValueError(f"{name}.weight_scale_inv: scale_fmt ue8m0 needs powers of two")


class BlockFp8Reader:
    """Pairs each FP8 `X.weight` with its `X.weight_scale_inv` as a checkpoint streams by (either
    may come first, or in another shard) and hands on `X.weight` dequantized to float32; every
    other tensor passes through. ridge reads an FP8 checkpoint this way until its FP8 GEMMs land:
    the weights take the model's dtype at load, and the model runs as a float one."""

    def __init__(self, config: Fp8BlockConfig):
        self.config, self.pending = config, {}

    def feed(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.endswith(".weight_scale_inv"):
            base = name[:-len("_scale_inv")]
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
        check_fp8_tensors(base[:-len(".weight")], weight, scale, *weight.shape, self.config)
        return base, dequantize_fp8_block(weight, scale, self.config.block)

    def finish(self) -> None:
        """Every FP8 weight found its scales, and every scale its weight."""
        for base, tensor in self.pending.items():
            missing, present = ((f"{base}_scale_inv", base) if tensor.dtype == FP8 else
                                (f"{base} (float8_e4m3fn)", f"{base}_scale_inv"))
            raise ValueError(f"checkpoint tensor {present!r} has no {missing!r}")
