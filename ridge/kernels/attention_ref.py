"""Pure-torch paged attention: the CPU backend and the oracle every attention kernel must match.

Layout of one layer's cache (a page = `page_size` consecutive token slots):
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
A token's slot is `page_id * page_size + offset`, so `cache.view(-1, kvh, d)[slot]` is its row.
A page is then one contiguous `page_size * kvh * d` run: a decode kernel reads whole pages with
wide, coalesced loads, and a slot write touches one row.

The batch is flat: sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`, which
are the *last* q_len tokens of its `seq_lens[i]` context tokens (earlier ones are already in the
cache: a prefix-cache hit, an earlier prefill chunk or earlier decode steps). A decode row is the
case q_len == 1; prefill chunks and decodes share one batch.

An FP8 cache (ridge/kernels/kv_fp8.py) is the same layout in float8_e4m3fn plus `kv_scales` =
(k_scale, v_scale), uint8 [num_pages, page_size, num_kv_heads]: one e8m0 byte per row, at the same
(page, offset, head) index as the row it scales. Every function here takes kv_scales=None and
requires it exactly when the caches are FP8.
"""
from __future__ import annotations

import torch

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.kv_fp8 import KVScales, check_kv_scales, dequantize_rows_ref, quantize_rows_ref

def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    """Scatter the new tokens' K/V rows ([T, kvh, d]) into their cache slots; into an FP8 cache,
    each row's e4m3 values and its scale byte (quantize_rows_ref)."""
    kvh, d = k.shape[1], k.shape[2]
    scales = check_kv_scales(k_cache, v_cache, kv_scales)
    if scales is None:
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    page = k_cache.shape[1]
    pages, offsets = slot_mapping // page, slot_mapping % page   # any scale strides, no view needed
    for x, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        rows, scale_bytes = quantize_rows_ref(x)
        # as bytes: torch's CPU index_copy_ has no float8 kernel, and a byte copy is exact
        cache.view(torch.uint8).view(-1, kvh, d).index_copy_(0, slot_mapping, rows.view(torch.uint8))
        scale[pages, offsets] = scale_bytes


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None,
                        kv_scales: KVScales | None = None) -> torch.Tensor:
    """Causal attention of q ([T, H, d]) over each sequence's paged context; returns [T, H, d].

    Gathers each sequence's pages (an FP8 cache's dequantized to float32), then a masked softmax
    in float32. Quadratic memory per sequence: this is the readable reference, not the fast path.
    """
    scales = check_kv_scales(k_cache, v_cache, kv_scales)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    for i, ctx_len in enumerate(meta.seq_lens_cpu):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        n_pages = (ctx_len + page_size - 1) // page_size
        pages = meta.page_tables[i, :n_pages].long()
        k, v = k_cache[pages], v_cache[pages]
        if scales is not None:
            k = dequantize_rows_ref(k, scales[0][pages], torch.float32)
            v = dequantize_rows_ref(v, scales[1][pages], torch.float32)
        k = k.reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        v = v.reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        # GQA: query head h reads kv head h // group.
        k = k.float().repeat_interleave(group, dim=1)          # [ctx, H, d]
        v = v.float().repeat_interleave(group, dim=1)
        out[q_lo:q_hi] = causal_attention_ref(q[q_lo:q_hi].float(), k, v, scale, sliding_window).to(q.dtype)
    return out


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         sliding_window: int | None = None) -> torch.Tensor:
    """One sequence: q [q_len, H, d] the last q_len of its k [ctx, H, d], v [ctx, H, dv] positions,
    masked softmax(q k^T * scale) v in q's dtype -> [q_len, H, dv]."""
    q_len, ctx_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale     # [H, q_len, ctx]
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
    k_pos = torch.arange(ctx_len, device=q.device)[None, :]
    masked = k_pos > q_pos
    if sliding_window is not None:
        masked |= k_pos <= q_pos - sliding_window
    scores.masked_fill_(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
