"""Triton paged-attention backend: pick the decode or the prefill kernel for one flat batch."""
from __future__ import annotations

import torch

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.kv_fp8 import KVScales
from ridge.kernels.decode_attention import decode_attention, fits_decode
from ridge.kernels.prefill_attention import prefill_attention


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           sliding_window: int | None = None,
                           out: torch.Tensor | None = None,
                           kv_scales: KVScales | None = None) -> torch.Tensor:
    """The contract of attention_ref.paged_attention_ref (K/V of the new tokens already cached),
    plus the new tokens' k, v ([T, kvh, d]), which the prefill kernel reads contiguously.

    A batch of at most MAX_QUERIES queries a sequence (decode; a speculative verify step's k + 1)
    whose queries x group heads fit one program's 128 rows goes to the split-KV decode kernel,
    whose GQA packing and context splitting suit a few query rows per sequence; anything else
    (a longer chunk, or too many rows) goes to the prefill kernel, which also serves
    the batch's decode rows. `out` ([T, H, d]) is optional.
    An FP8 cache comes with kv_scales = (k_scale, v_scale); k, v are then its dequantized values.
    """
    if fits_decode(meta.max_query_len, q.shape[1] // k_cache.shape[2]):
        return decode_attention(q, k_cache, v_cache, meta, scale, sliding_window, out=out, kv_scales=kv_scales)
    return prefill_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, out=out,
                             kv_scales=kv_scales)
