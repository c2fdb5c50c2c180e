"""Multi-head Latent Attention's attention step (DeepSeek-V2/V3): rotate the query's and the
shared key's rotary parts, write each new token's [latent, k_pe] row into the paged latent cache,
attend over each sequence's cached rows.

Why the latent cache: a GQA cache holds 2 x kv_heads x head_dim values a token a layer (8B Llama:
2048); MLA holds kv_lora_rank + rope_dim (DeepSeek-V2-Lite and V3: 512 + 64 = 576) for all heads,
so decode, bound by cache bytes at long contexts, reads 3.6x to 14x fewer bytes, and the pool holds
that many more tokens. The per-head K and V are never stored: head h's K_nope and V are the
latent times its slices of W_kv_b. The attention itself is ridge/kernels/mla_attention.py's: on
CUDA (and under the Triton backend) a decode-only step runs the absorbed kernel, and rotary and the
cache write one kernel (`rope_write_latent`: torch's rotary is a chain of small elementwise
kernels), with no host-side look at the batch, so the padded static decode path holds the step;
prefill (and a CPU's torch backend) runs the reference that expands the latents.

Cost (what the absorbed decode form moves and computes, the design the kernels follow): each
cached row is read once for all heads (r + rope values); the up-projections fold into the query
(q_nope W_UK^T: 2 H nope r FLOPs a token) and the output (2 H r v), and each (query row, key)
pair costs 2 (r + rope) + 2 r FLOPs a head.
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.kernels.attention_meta import AttentionMetadata, KVCacheSpec, LatentPages
from ridge.kernels.mla_attention import (absorb_query, mla_attention_ref, mla_decode_attention, rope_write_latent,
                                         rope_write_latent_ref, unabsorb_output)
from ridge.kernels.mla_prefill import mla_prefill_attention
from ridge.layers.attention import AttentionBackend, PagedAttention, attention_keys_read, attention_pairs
from ridge.layers.cost import OpCost, StepShape
from ridge.layers.rotary import RotaryEmbedding


class LatentAttention(PagedAttention):
    def __init__(self, num_heads: int, kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int, scale: float,
                 rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = \
            num_heads, kv_lora_rank, nope_dim, rope_dim, v_dim
        self.scale, self.rotary, self.backend = scale, rotary, backend
        # the Triton backend (the interpreter's static decode path on a CPU) or CUDA: the cache
        # write and decode-only steps run the kernels; the torch backend on a CPU, the references
        self.kernels = backend.name == "triton"
        self.kernels_fit = kv_lora_rank & (kv_lora_rank - 1) == 0          # the decode kernel tiles the latent
        # the prefill kernel splits its dot products at nope | rope and tiles the values
        self.prefill_fits = all(d >= 16 and d & (d - 1) == 0 for d in (nope_dim, rope_dim, v_dim))

    def kv_cache_spec(self) -> KVCacheSpec:
        """One [latent, k_pe] row a token for all heads, in the backend's cache dtype."""
        dtype = self.backend.kv_cache_dtype
        if dtype is None or self.backend.kv_scale_dtype is not None:
            raise ValueError("kv_cache_dtype: an FP8 cache is not supported for latent attention (DeepSeek) yet"
                             if dtype is not None else "latent attention: the backend has no kv_cache_dtype")
        return KVCacheSpec(1, 1, self.kv_lora_rank + self.rope_dim, dtype, latent=True)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor, kv_cache: LatentPages, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, nope + rope], latent [T, r] (normalised), k_pe [T, rope], not yet rotated;
        kv_b_weight [H (nope + v), r]; kv_cache: this layer's latent pages -> [T, H, v]."""
        cache = kv_cache.latent
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kernels = self._kernels(q)
        q_pe = self._rotate_and_write(positions, q_pe, latent, k_pe, cache, meta.slot_mapping)
        if kernels and meta.is_decode_only:      # the absorbed form over the latents themselves
            o_lat = mla_decode_attention(absorb_query(q_nope, kv_b_weight), q_pe, cache, meta, self.scale)
            return unabsorb_output(o_lat, kv_b_weight, self.nope_dim)
        attend = mla_prefill_attention if kernels and self.prefill_fits else mla_attention_ref
        return attend(torch.cat((q_nope, q_pe), dim=-1), cache, kv_b_weight, meta, self.scale, self.nope_dim,
                      self.v_dim)

    def _kernels(self, x: torch.Tensor) -> bool:
        return self.kernels or (x.is_cuda and self.kernels_fit)

    def _rotate_and_write(self, positions, q_pe, latent, k_pe, cache, slot_mapping) -> torch.Tensor:
        """q_pe rotated; the rows' [latent, rotated k_pe] written to their cache slots."""
        write = rope_write_latent if self._kernels(latent) else rope_write_latent_ref
        return write(positions, q_pe, latent, k_pe, self.rotary.cos, self.rotary.sin, cache, slot_mapping)

    def write_kv(self, positions: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: LatentPages,
                 slot_mapping: torch.Tensor) -> None:
        """Only the rotation and the cache write of forward, no attention (a draft head's rows whose
        output nobody reads). The rotation takes a query: k_pe itself, one head, is the cheapest."""
        self._rotate_and_write(positions, k_pe[:, None], latent, k_pe, kv_cache.latent, slot_mapping)

    def cost(self, step: StepShape, kv_b_bytes: int = 0) -> list[OpCost]:
        """kv_b_bytes: the up-projection's weight, read once a step. A decode-only step runs the
        absorbed form (kv_b folded into q and the output); any other step the expanded one (the
        context's latents up-projected once, then per-head attention over 192-wide keys)."""
        H, r, rope, nope, v = self.num_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim
        T, a, c, lens = step.num_tokens, step.act.bytes, step.kv_elt, list(zip(step.query_lens, step.context_lens))
        row = (r + rope) * c
        written, read = T * row, sum(attention_keys_read(ql, cl) for ql, cl in lens) * row
        pairs = sum(attention_pairs(ql, cl) for ql, cl in lens)
        rope_write = OpCost("rope_latent_write", "elementwise", 3 * T * (H + 1) * rope,
                            T * (2 * H * rope + rope + r) * a + written, kv_bytes=written, compute=step.act.compute)
        if step.num_prefill_tokens == 0:
            absorb = 2 * T * H * (nope * r + r * v)
            return [rope_write, OpCost("attention", "attention", absorb + H * pairs * (4 * r + 2 * rope),
                                       T * H * (nope + rope + v) * a + read + kv_b_bytes, kv_b_bytes, kv_bytes=read,
                                       compute=step.act.compute)]
        context = sum(cl for _, cl in lens)
        expanded = context * H * (nope + v) * a                      # written by the expansion, read by attention
        return [rope_write,
                OpCost("latent_expand", "gemm", 2 * context * r * H * (nope + v), read + kv_b_bytes + expanded,
                       kv_b_bytes, kv_bytes=read, compute=step.act.compute),
                OpCost("attention", "attention", H * pairs * (2 * (nope + rope) + 2 * v),
                       T * H * (2 * (nope + rope) + v) * a + expanded + context * rope * a, compute=step.act.compute)]
