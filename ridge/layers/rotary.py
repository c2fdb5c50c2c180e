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
    raise ValueError(f"model: rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """The fp32 cos/sin tables, [max_position, head_dim], shared by every layer's Attention."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inverse_frequencies(head_dim, theta, scaling)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
