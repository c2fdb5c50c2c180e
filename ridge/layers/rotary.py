"""Rotary position embedding (the rotate-half / NeoX layout that HF Llama checkpoints use).

cos/sin are computed once for every position up to max_position in float32, exactly as
transformers computes them (inverse frequencies in float32, one product per element), and
gathered per token: a decode step costs one gather, not a cos/sin per token. Rotation is always
followed by the KV-cache write, so the Attention layer makes the two one backend call,
`rope_write_kv` (ridge/kernels/rotary.py): on Triton one kernel computing in fp32 and rounding
once; the torch reference (the CPU path and the oracle) rounds cos/sin and every intermediate to
the input dtype as transformers does.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where(~(wavelen < high_wavelen) * ~(wavelen > low_wavelen), smoothed, scaled)
    if kind == "yarn":
        # YaRN (as transformers computes it): interpolate the low frequencies by 1/factor, keep the
        # high ones, and ramp linearly between the dims that turn beta_fast and beta_slow times
        # over the original context
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:
            return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(fast), dim_of(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    raise ValueError(f"model: rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def attention_factor(scaling: dict | None) -> float:
    """YaRN's factor on cos/sin (transformers': mscale over mscale_all_dim, or 0.1 ln(factor) + 1)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """The fp32 cos/sin tables, [max_position, head_dim], shared by every layer's Attention."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inverse_frequencies(head_dim, theta, scaling)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)
