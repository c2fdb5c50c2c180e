"""The one attention interface the model calls: rotate q and k, write the new K/V into the paged
cache, then attend over each sequence's pages. The backend is picked once, by device: the
pure-torch reference on the CPU, ridge's Triton kernels on CUDA where they exist. Rotary and the
cache write are one backend call, `rope_write_kv` (every rotated k is written at once), one Triton
kernel per layer: one launch and one inter-kernel gap fewer per layer in a decode step.
"""
from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from ridge.kernels.attention_meta import AttentionMetadata, KVCacheSpec, KVPages
from ridge.kernels.attention_ref import paged_attention_ref
from ridge.kernels.attention_triton import triton_paged_attention
from ridge.kernels.decode_tuning import tune_decode_attention
from ridge.kernels.kv_fp8 import FP8 as KV_FP8, SCALE_DTYPE as KV_SCALE_DTYPE
from ridge.kernels.rotary import rope_write_kv, rope_write_kv_ref
from ridge.layers.rotary import RotaryEmbedding
from ridge.layers.cost import OpCost, StepShape
from ridge.parallel import TensorParallel


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, kv_scales, rotation) -> (q, k, v)
    # as attention reads them; k and v written to their slots (negative slot: none)
    rope_write_kv: Callable
    # (q, k, v, k_cache, v_cache, meta, scale, window, kv_scales) -> attention output
    attend: Callable
    # the +-1 Hadamard matrix [head_dim, head_dim] that rotates q and k before an FP8 cache
    # quantizes k (--kv-cache-hadamard; ridge/kernels/kv_fp8.py), or None
    kv_rotation: torch.Tensor | None = None
    # what the layers' pages hold: the model dtype, or e4m3 with a scale byte a row (ridge/kernels/kv_fp8.py);
    # None: a backend the caller gives its own caches (no pool declared)
    kv_cache_dtype: torch.dtype | None = None

    @property
    def kv_scale_dtype(self) -> torch.dtype | None:
        """The scale of each cached row: an FP8 cache's rows carry one, others none."""
        return KV_SCALE_DTYPE if self.kv_cache_dtype == KV_FP8 else None


# the reference reads every key, new ones included, back from the cache: the oracle
TORCH_BACKEND = AttentionBackend("torch", rope_write_kv_ref,
                                 lambda q, k, v, k_cache, v_cache, meta, scale, window=None, kv_scales=None:
                                 paged_attention_ref(q, k_cache, v_cache, meta, scale, window, kv_scales))


def select_backend(device: torch.device, name: str = "auto", head_dim: int = 128,
                   kv_rotation: torch.Tensor | None = None, latent_rank: int | None = None,
                   kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """latent_rank: an MLA model's kv_lora_rank (its kernels tile the latent, any rotary width);
    kv_cache_dtype: the pool's (AttentionBackend.kv_cache_dtype)."""
    if latent_rank is not None:
        triton_ok = latent_rank & (latent_rank - 1) == 0
        need = f"a power-of-two kv_lora_rank, this model has {latent_rank}"
    else:                                                    # tiled as one power-of-two block
        triton_ok, need = 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0, \
            f"a power-of-two head_dim in [16, 256], this model has {head_dim}"
    if name == "torch" or (name == "auto" and (device.type != "cuda" or not triton_ok)):
        return replace(TORCH_BACKEND, kv_rotation=kv_rotation, kv_cache_dtype=kv_cache_dtype)
    if not triton_ok:
        raise ValueError(f"attention_backend: the triton kernels need {need}")
    if name in ("auto", "triton"):
        return AttentionBackend("triton", rope_write_kv, triton_paged_attention, kv_rotation, kv_cache_dtype)
    raise ValueError(f"attention_backend: unknown backend {name!r}; expected auto, torch or triton")


def rank_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int, int, int]:
    """(query heads, KV heads, first query head, first KV head) of this tensor-parallel rank: an
    equal share of the query heads and of the KV heads, or, with fewer KV heads than ranks, a copy
    of the one KV head its query heads read (the cache then holds it on each of those ranks)."""
    first_q, heads = tp.split(num_heads, "the number of attention heads")
    if num_kv_heads >= tp.size:
        first_kv, kv_heads = tp.split(num_kv_heads, "the number of KV heads")
        return heads, kv_heads, first_q, first_kv
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: must be a multiple of the KV heads ({num_kv_heads}) when larger "
                         f"than their number, got {tp.size}")
    return heads, 1, first_q, first_q // (num_heads // num_kv_heads)


def attention_pairs(query_len: int, context_len: int, window: int | None = None) -> int:
    """(query row, key) pairs of one sequence under the causal mask: the row at position p sees
    keys max(0, p - window + 1) .. p, i.e. min(p + 1, window) of them."""
    lo, hi = context_len - query_len + 1, context_len          # keys seen by the first / last row
    if window is None or hi <= window:
        return (lo + hi) * query_len // 2
    m = min(lo, window + 1)                                    # rows under the window see m .. window
    return (m + window) * (window - m + 1) // 2 + window * (hi - max(lo, window + 1) + 1)


def attention_keys_read(query_len: int, context_len: int, window: int | None = None) -> int:
    """Distinct cached keys a sequence's rows read (the union of their windows)."""
    return context_len if window is None else min(context_len, query_len + window - 1)


log = logging.getLogger("ridge")


def tune_decode_kernels(model: nn.Module, kv_cache: KVPages, max_batch: int, max_span: int, dtype: torch.dtype) -> int:
    """Before the first request: the split-KV decode kernel tuned for every key an eager step of up
    to max_batch sequences and max_span tokens can meet (ridge/kernels/decode_tuning.py), once for
    each distinct attention shape of the model (heads, window), on one layer's pages; the Triton
    backend only; `dtype`: the activations'. Returns the keys tuned."""
    shapes = {(m.num_heads, m.sliding_window, m.scale) for m in model.modules()
              if isinstance(m, Attention) and m.backend.name == "triton"}
    if not shapes or not isinstance(kv_cache, KVPages):
        return 0
    t0 = time.perf_counter()
    n = sum(tune_decode_attention(h, kv_cache.k, kv_cache.v, scale, window, max_batch, max_span, dtype, kv_cache.scales)
            for h, window, scale in shapes)
    log.info("decode attention tuned for %d keys of eager steps in %.1f s", n, time.perf_counter() - t0)
    return n


class PagedAttention(nn.Module, abc.ABC):
    """An attention layer over the paged KV pool: it declares what it keeps a token
    (kv_cache_spec) and reads its pages (KVPages / LatentPages) by that declaration's fields."""

    @abc.abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """What this layer keeps a token in each page of the pool."""


def kv_cache_spec_of(model: nn.Module) -> KVCacheSpec:
    """What every attention layer of `model` keeps a token (this rank's KV heads): the pool is one
    tensor for all layers, so they must declare one format."""
    specs = {m.kv_cache_spec() for m in model.modules() if isinstance(m, PagedAttention)}
    if len(specs) != 1:
        raise ValueError(f"model: its attention layers declare {len(specs)} KV cache formats; the pool holds one")
    return specs.pop()


class Attention(PagedAttention):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.backend, self.rotary = head_dim ** -0.5, sliding_window, backend, rotary

    def kv_cache_spec(self) -> KVCacheSpec:
        """A K and a V row a token and kv head, in the backend's cache dtype (FP8: a scale byte a row)."""
        if self.backend.kv_cache_dtype is None:
            raise ValueError(f"attention backend {self.backend.name!r}: no kv_cache_dtype, so no pool to declare")
        return KVCacheSpec(2, self.num_kv_heads, self.head_dim, self.backend.kv_cache_dtype,
                           self.backend.kv_scale_dtype)

    def forward(self, positions, q, k, v, kv_cache: KVPages, meta: AttentionMetadata):
        """q: [T, H, d], k, v: [T, kvh, d], not yet rotated (any strides); positions: [T]; kv_cache:
        this layer's pages (its k_scale, v_scale for an FP8 cache)."""
        kv_scales = kv_cache.scales
        q, k, v = self.backend.rope_write_kv(positions, q, k, v, self.rotary.cos, self.rotary.sin, kv_cache.k,
                                             kv_cache.v, meta.slot_mapping, kv_scales, self.backend.kv_rotation)
        return self.backend.attend(q, k, v, kv_cache.k, kv_cache.v, meta, self.scale, self.sliding_window,
                                   kv_scales=kv_scales)

    def write_kv(self, positions, q, k, v, kv_cache: KVPages, slot_mapping: torch.Tensor) -> None:
        """Only the rotation and the cache write of forward, no attention: for a layer whose cached
        entries depend on its input alone (an EAGLE-3 head catching up on positions whose output
        nobody reads)."""
        self.backend.rope_write_kv(positions, q, k, v, self.rotary.cos, self.rotary.sin, kv_cache.k, kv_cache.v,
                                   slot_mapping, kv_cache.scales, self.backend.kv_rotation)

    def cost(self, step: StepShape) -> list[OpCost]:
        """rope_kv_write: q*cos + rotate(q)*sin, 3 FLOPs an element of q and k; reads q, k, v and the
        cos/sin tables (head_dim/2 distinct values of each a position), writes the rotated q and k
        and the new K/V rows. attention: reads Q, writes O, reads each sequence's cached K/V once."""
        H, K, d, w = self.num_heads, self.num_kv_heads, self.head_dim, self.sliding_window
        T, a, c, lens = step.num_tokens, step.act.bytes, step.kv_elt, list(zip(step.query_lens, step.context_lens))
        q, kv, table = H * d, K * d, d * self.rotary.cos.element_size()
        written, read = T * 2 * kv * c, sum(attention_keys_read(ql, cl, w) for ql, cl in lens) * 2 * kv * c
        pairs = sum(attention_pairs(ql, cl, w) for ql, cl in lens)
        return [OpCost("rope_kv_write", "elementwise", 3 * T * (H + K) * d,
                       T * (2 * q + 3 * kv) * a + T * table + written, kv_bytes=written, compute=step.act.compute),
                OpCost("attention", "attention", 4 * H * d * pairs, 2 * T * q * a + read, kv_bytes=read,
                       compute=step.act.compute)]
