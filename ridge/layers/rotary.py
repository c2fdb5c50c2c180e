"""Rotary position embedding (the rotate-half / NeoX layout that HF Llama checkpoints use).

cos/sin are computed once for every position up to max_position in float32, exactly as
transformers computes them (inverse frequencies in float32, one product per element), and
gathered per token: a decode step then costs one gather, not a cos/sin per token.

Rotation is always followed by the KV-cache write, so the two are one backend call,
`AttentionBackend.rope_write_kv`, made by the Attention layer (ridge/layers/attention.py). The
Triton backend runs them as one kernel (ridge/kernels/rotary.py), computing in fp32 from the
fp32 tables and rounding once; the torch backend (the CPU path and the oracle) runs
`rope_write_kv_ref` below: this reference rotation, which rounds cos/sin and every intermediate
to the input dtype as transformers does, then write_kv_ref.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ridge.kernels.attention_ref import write_kv_ref


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"model: rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                     sin_table: torch.Tensor):
    """q: [T, H, d], k: [T, kvh, d]; positions: [T]; tables [max_position, d] float32."""
    cos = cos_table[positions].to(q.dtype)[:, None, :]
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_write_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_table: torch.Tensor, sin_table: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Rotate q, k and write the rotated k and v into their cache slots; returns the rotated
    (q, k). The torch backend's rope_write_kv and the reference of the fused kernel."""
    q, k = apply_rotary_ref(positions, q, k, cos_table, sin_table)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


class RotaryEmbedding(nn.Module):
    """The fp32 cos/sin tables, [max_position, head_dim], shared by every layer's Attention."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
