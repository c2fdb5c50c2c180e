"""INT4 weight-only (W4A16): which format a checkpoint is in, read from its quantization_config.

"awq", "gptq" and "compressed-tensors" name the format a checkpoint is in; "int4" quantizes a float
checkpoint while it loads (round to nearest, asymmetric min-max, group 128). A configuration ridge
cannot run (bits, group size, a scheme with activation quantization, an unknown method) is a
ValueError naming the config.json field, raised before any weight is read. The layers' tables and
kernels: linear.py (dense projections), experts.py (mixture-of-experts experts, quantized at load).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ridge.layers.quant.base import ExpertsMethod, LinearMethod, QuantConfig, compressed_tensors_groups

FORMATS = ("awq", "gptq", "compressed-tensors")
AT_LOAD_GROUP = 128
# module names a "not converted" entry may match: what ridge keeps unquantized anyway; and (HF Llama
# names, one layer's) the projections it may not match
_UNQUANTIZED = ("lm_head", "model.embed_tokens")
_PROJECTIONS = tuple(f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


@dataclass(frozen=True)
class Int4Config(QuantConfig):
    """One INT4 scheme for every projection. group_size -1: one group spans all K inputs."""
    format: str                       # "awq", "gptq", "compressed-tensors", or "int4" (quantized at load)
    group_size: int
    symmetric: bool = False           # z = 8 and no zero-point tensor (compressed-tensors symmetric)
    desc_act: bool = False            # GPTQ act-order: a group's rows are scattered (g_idx)
    has_g_idx: bool = False           # the checkpoint carries a g_idx tensor per layer
    checkpoint_format: str = "gptq"   # GPTQ: "gptq" (v1: z - 1 stored) or "gptq_v2"

    def group_for(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    @property
    def name(self) -> str:
        return self.format

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        """The INT4 path of `layer` (a Linear), its tables registered on it."""
        from ridge.layers.quant.int4.linear import Int4Linear
        method = Int4Linear(self, layer)
        method.create_weights(layer)
        return method

    def experts_method(self, layer: nn.Module) -> ExpertsMethod:
        """Experts quantized at load (the registry admits only the "int4" format for experts)."""
        from ridge.layers.quant.int4.experts import Int4AtLoadExperts
        return Int4AtLoadExperts()

    @classmethod
    def from_hf(cls, qc: dict) -> "Int4Config":
        """From config.json's quantization_config (AutoAWQ, GPTQ, compressed-tensors)."""
        if not isinstance(qc, dict):
            raise ValueError(f"quantization_config: must be a mapping, got {type(qc).__name__}")
        method = str(qc.get("quant_method", "")).lower()
        if method == "awq":
            _bits(qc.get("bits", qc.get("w_bit")), "quantization_config.bits")
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"quantization_config.version: {version!r} is not supported "
                                 f"(ridge reads AutoAWQ's GEMM layout)")
            if qc.get("zero_point", True) is not True:
                raise ValueError(f"quantization_config.zero_point: {qc.get('zero_point')!r} is not supported "
                                 f"(AutoAWQ GEMM checkpoints carry zero points)")
            _not_converted(qc.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert", True)
            return cls("awq", _group(qc.get("group_size", qc.get("q_group_size")), "quantization_config.group_size"))
        if method == "gptq":
            _bits(qc.get("bits"), "quantization_config.bits")
            fmt = qc.get("checkpoint_format") or "gptq"
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported (gptq or gptq_v2)")
            if qc.get("lm_head"):
                raise ValueError("quantization_config.lm_head: true is not supported (ridge keeps the LM head unquantized)")
            if qc.get("dynamic"):
                raise ValueError("quantization_config.dynamic: per-module overrides are not supported")
            return cls("gptq", _group(qc.get("group_size"), "quantization_config.group_size"),
                       symmetric=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)), has_g_idx=True,
                       checkpoint_format=fmt)
        if method == "compressed-tensors":
            return _compressed_tensors(qc)
        raise ValueError(f"quantization_config.quant_method: {qc.get('quant_method')!r} is not supported "
                         f"(ridge loads INT4 {', '.join(FORMATS)})")


def _bits(bits, field: str) -> None:
    if bits != 4:
        raise ValueError(f"{field}: {bits!r} is not supported (INT4 only)")


def _group(g, field: str) -> int:
    if isinstance(g, bool) or not isinstance(g, int) or not (g > 0 or g == -1):
        raise ValueError(f"{field}: {g!r} is not supported (a positive group size, or -1 for one group per output)")
    return g


def _not_converted(entries, field: str, substring: bool) -> None:
    """Modules a config leaves unquantized: ridge quantizes every projection and only those."""
    for e in entries or ():
        if substring:
            hit = [m for m in _PROJECTIONS if e in m]
        else:       # compressed-tensors: the module's full name, or "re:" and a regex matched from its start
            hit = [m for m in _PROJECTIONS if (re.match(e[3:], m) if e.startswith("re:") else e == m)]
        if hit:
            raise ValueError(f"{field}: {e!r} leaves projections unquantized (e.g. {hit[0]}); ridge quantizes every "
                             f"projection and keeps only {' and '.join(_UNQUANTIZED)} in the activation dtype")


def _compressed_tensors(qc: dict) -> Int4Config:
    top = qc.get("format")
    groups = compressed_tensors_groups(qc, "weight-only INT4")
    schemes = set()
    for name, group in groups.items():
        field = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or top
        if fmt != "pack-quantized":
            raise ValueError(f"{field}.format: {fmt!r} is not supported (INT4 pack-quantized only)")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"{field}.input_activations: activation quantization is not supported (W4A16 only)")
        w = group.get("weights") or {}
        _bits(w.get("num_bits"), f"{field}.weights.num_bits")
        if w.get("type", "int") != "int":
            raise ValueError(f"{field}.weights.type: {w.get('type')!r} is not supported (int only)")
        strategy = w.get("strategy") or ("channel" if w.get("group_size") in (None, -1) else "group")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{field}.weights.strategy: {strategy!r} is not supported (group or channel)")
        if w.get("dynamic"):
            raise ValueError(f"{field}.weights.dynamic: {w['dynamic']!r} is not supported (static weights only)")
        size = -1 if strategy == "channel" else _group(w.get("group_size"), f"{field}.weights.group_size")
        actorder = str(w.get("actorder")).lower()
        schemes.add((size, bool(w.get("symmetric", True)), actorder in ("group", "dynamic")))
    if len(schemes) > 1:
        raise ValueError("quantization_config.config_groups: groups with different weight schemes are not supported")
    _not_converted(qc.get("ignore"), "quantization_config.ignore", False)
    size, symmetric, g_idx = schemes.pop()
    return Int4Config("compressed-tensors", size, symmetric=symmetric, has_g_idx=g_idx)
