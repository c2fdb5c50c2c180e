"""Tuning the split-KV decode kernel at start-up (ridge/kernels/decode_tuning.py): the shapes it runs
reach every autotuning key a call of the engine's limits can meet (checked against calls drawn at
random, as a GPU with 132 SMs splits them), and on a GPU no call within the limits tunes anything
afterwards."""
from __future__ import annotations

import random

import pytest
import torch

import ridge.kernels.decode_attention as da
from ridge.kernels.decode_tuning import key_of, tuning_shapes

H100 = torch.device("cuda")     # a device object only: the split rule is the GPU's, nothing runs


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    monkeypatch.setattr(da, "_INTERPRET", False)
    monkeypatch.setattr(da, "_device_sms", lambda device: 132)


@pytest.mark.parametrize("max_batch,max_span,kv_heads,group", [(128, 8192, 8, 4), (256, 131072, 8, 8),
                                                              (64, 3000, 2, 16), (16, 700, 32, 1)])
def test_the_shapes_reach_every_key_a_call_can_meet(as_on_a_gpu, max_batch, max_span, kv_heads, group):
    shapes = tuning_shapes(max_batch, max_span, kv_heads, group, H100)
    for key, (batch, span, queries) in shapes.items():
        assert key_of(batch, span, queries, kv_heads, group, H100) == key
        assert batch <= max_batch and span <= max_span and da.fits_decode(queries, group)
    rng = random.Random(0)
    spans = [*range(1, min(max_span, 5000) + 1, 3), max_span]
    met = {key_of(rng.randint(1, max_batch), rng.choice(spans) if rng.random() < 0.7 else rng.randint(1, max_span),
                  q, kv_heads, group, H100)
           for _ in range(20000) for q in [rng.randint(1, da.MAX_QUERIES)] if da.fits_decode(q, group)}
    assert met <= set(shapes)


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_a_query_tile_holds_every_query_it_is_used_for(group):
    tiles = set()
    for q in range(1, da.MAX_QUERIES + 1):
        if not da.fits_decode(q, group):
            continue
        queries, block_h = da.query_rows(q, group)
        assert q <= queries <= da.MAX_QUERIES and queries * group <= block_h and block_h >= 16
        tiles.add((queries, block_h))
    assert len(tiles) <= 4         # 2 to 8 queries share a few compiled variants


@pytest.mark.gpu
def test_gpu_after_tuning_no_call_within_the_limits_tunes():
    from ridge.kernels.attention_meta import AttentionMetadata
    from ridge.kernels.attention_ref import paged_attention_ref
    from ridge.kernels.decode_tuning import tune_decode_attention

    dev, heads, kv_heads, d, page, pages = torch.device("cuda"), 32, 8, 128, 16, 4096
    k = torch.randn(pages, page, kv_heads, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    n = tune_decode_attention(heads, k, v, d ** -0.5, None, 24, 2048, torch.bfloat16)
    tuned = len(da._decode_split_kernel.cache)
    assert n > 0 and tuned >= n
    rng = random.Random(1)
    for i in range(40):
        batch, queries = rng.randint(1, 24), rng.choice([1, 1, 2, 3, 5, 8])
        lens = [rng.randint(queries, 2048) for _ in range(batch)]
        tables = torch.randint(0, pages, (batch, 128), dtype=torch.int32, device=dev)
        starts = [i * queries for i in range(batch + 1)]
        meta = AttentionMetadata(torch.empty(0, dtype=torch.int64, device=dev),
                                 torch.tensor(starts, dtype=torch.int32, device=dev),
                                 torch.tensor(lens, dtype=torch.int32, device=dev), tables, starts, lens, queries,
                                 max(lens))
        q = torch.randn(batch * queries, heads, d, dtype=torch.bfloat16, device=dev)
        out = da.decode_attention(q, k, v, meta, d ** -0.5)
        if i < 3:
            torch.testing.assert_close(out.float(), paged_attention_ref(q, k, v, meta, d ** -0.5).float(),
                                       atol=2e-2, rtol=2e-2)
    assert len(da._decode_split_kernel.cache) == tuned
