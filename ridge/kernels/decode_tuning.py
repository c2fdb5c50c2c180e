"""Tuning the split-KV decode kernel before the first request, for every key an eager call can meet.

The kernel's best tile and pipeline depth depend on the keys each program streams and on how many
programs share the SMs, so its autotuner keys on both, bucketed, beside the query tile and whether
the call splits the context (ridge/kernels/decode_attention.py, launch_key). CUDA-graph replays
never reach the autotuner: their launches were fixed at capture. An eager call does (a step that
is not a pure decode or verify batch: a prefix-cache hit leaving a few prompt tokens beside
decodes, a verify step past the verify graphs' batch), and the first call of each new key times
every config, with their compiles, inside a step: a serving-path trace showed such steps take
0.5-3.3 s while every stream waits (docs/benchmarks/serving.md#soak-gpu-2026-11-28).

The reachable keys are few (a model's query tiles x direct or split x 4 work x 3 grid buckets, of
which a batch's and a context's range reach a subset), and which one a call takes is a pure
function of its batch, context and queries. So the engine enumerates them for its own limits
(max_num_seqs, max_model_len, the model's heads) and runs one call of each at start-up; Triton
keeps the picks on disk beside the compiled kernels (cache_results), so a later start on the same
machine replays them instead of timing again.
"""
from __future__ import annotations

import torch
import triton

from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.decode_attention import (MAX_QUERIES, choose_num_splits, decode_attention, fits_decode, launch_key,
                                            query_rows)
from ridge.kernels.kv_fp8 import KVScales

_WORK_EDGES = (256, 1024, 4096)    # keys a program: where _tuning_buckets' work bucket steps up


def _spans(batch: int, max_span: int, num_kv_heads: int, device: torch.device) -> set[int]:
    """Contexts that take a batch of `batch` sequences through every key it can reach: the split
    count grows one per 256 keys up to its cap, so each count's first context (a multiple of 256:
    exactly 256 keys a program) and the one after it, and past the cap each work bucket's first
    context; with one split the work edges themselves."""
    cap = choose_num_splits(batch, num_kv_heads, 1 << 40, device)
    spans = {1, max_span, *(e + d for e in _WORK_EDGES for d in (0, 1))}
    for splits in range(2, cap + 1):
        spans |= {256 * splits, 256 * splits + 1}
    spans |= {cap * e + 1 for e in _WORK_EDGES}
    return {s for s in spans if 1 <= s <= max_span}


def tuning_shapes(max_batch: int, max_span: int, num_kv_heads: int, group: int,
                  device: torch.device) -> dict[tuple, tuple[int, int, int]]:
    """{tuning key: (sequences, context keys, queries a sequence)} of one call per key that calls of
    up to max_batch sequences, max_span context keys and MAX_QUERIES queries a sequence can meet.
    The key is launch_key's with the split count reduced to direct (one split) or not."""
    queries = {query_rows(q, group): q for q in range(MAX_QUERIES, 0, -1) if fits_decode(q, group)}
    shapes: dict[tuple, tuple[int, int, int]] = {}
    for batch in range(1, max_batch + 1):
        for span in sorted(_spans(batch, max_span, num_kv_heads, device)):
            for q in queries.values():
                shapes.setdefault(key_of(batch, span, q, num_kv_heads, group, device), (batch, span, q))
    return shapes


def key_of(batch: int, span: int, queries: int, num_kv_heads: int, group: int, device: torch.device) -> tuple:
    splits, *rest = launch_key(batch, num_kv_heads, group, span, queries, device)
    return (splits == 1, *rest)


@torch.inference_mode()
def tune_decode_attention(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                          sliding_window: int | None, max_batch: int, max_span: int, dtype: torch.dtype,
                          kv_scales: KVScales | None = None) -> int:
    """One call of every key (tuning_shapes) on this layer's pool, for a model's attention shape;
    returns the number of keys. The calls read the pool's pages (distinct pages, wrapping around
    the pool, so the timings stream from memory as serving does) and write only their own output."""
    num_pages, page, num_kv_heads, head_dim = k_cache.shape
    group, device = num_heads // num_kv_heads, k_cache.device
    span_cap = min(max_span, sliding_window) if sliding_window else max_span
    shapes = tuning_shapes(max_batch, span_cap, num_kv_heads, group, device)
    for batch, span, queries in shapes.values():
        per_seq = triton.cdiv(span, page)
        tables = (torch.arange(batch * per_seq, device=device) % num_pages).view(batch, per_seq).to(torch.int32)
        starts = list(range(0, (batch + 1) * queries, queries))
        meta = AttentionMetadata(torch.empty(0, dtype=torch.int64, device=device),
                                 torch.tensor(starts, dtype=torch.int32, device=device),
                                 torch.full((batch,), span, dtype=torch.int32, device=device), tables,
                                 starts, [span] * batch, queries, span)
        q = torch.randn(batch * queries, num_heads, head_dim, dtype=dtype, device=device)
        decode_attention(q, k_cache, v_cache, meta, scale, sliding_window, kv_scales=kv_scales)
    return len(shapes)
