"""The latent-attention kernels (ridge/kernels/mla_attention.py, mla_prefill.py) against the expanding
reference in Triton's interpreter: the absorbed decode over a paged latent cache, the expanded prefill
over prompts, chunks and decode rows, and the fused rotary + latent write. (DeepSeek models in the
engine: tests/models/test_mla.py; the kernels at DeepSeek's shapes on a GPU: tests/models/test_mla_gpu.py.)"""
import pytest
import torch
import triton

interpret = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                               reason="Triton kernels on a CPU need TRITON_INTERPRET=1")


def _decode_batch(ctx_lens, H, r, rope, nope, v, dtype, page=16, seed=0, q_lens=None):
    """A paged latent cache and a batch whose sequence i has q_lens[i] query rows (1: decode) at the
    end of its ctx_lens[i] positions."""
    from ridge.kernels.attention_meta import AttentionMetadata
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // page) for n in ctx_lens]
    perm = torch.randperm(sum(pages_each) + 3, generator=g)
    tables = torch.zeros(len(ctx_lens), max(pages_each), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages_each):
        tables[i, :n] = perm[used:used + n]
        used += n
    cache = torch.randn(len(perm), page, 1, r + rope, generator=g).to(dtype)
    q_lens = q_lens or [1] * len(ctx_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(ctx_lens, dtype=torch.int32), page_tables=tables,
                             query_start_loc_cpu=starts, seq_lens_cpu=list(ctx_lens), max_query_len=max(q_lens),
                             max_seq_len=max(ctx_lens))
    q = torch.randn(starts[-1], H, nope + rope, generator=g).to(dtype)
    kv_b = (torch.randn(H * (nope + v), r, generator=g) * r ** -0.5).to(dtype)
    return q, cache, kv_b, meta


@interpret
@pytest.mark.parametrize("keys_major", [False, True], ids=["heads-major", "keys-major"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("H", [4, 20])          # fewer heads than BLOCK_H; more than one head block
def test_absorbed_decode_matches_the_expanded_reference(H, splits, keys_major):
    from ridge.kernels.mla_attention import (MLADecodeTiles, absorb_query, mla_attention_ref, mla_decode_attention,
                                             unabsorb_output)
    r, rope, nope, v = 32, 8, 16, 24
    q, cache, kv_b, meta = _decode_batch([1, 17, 70, 33], H, r, rope, nope, v, torch.float32)
    ref = mla_attention_ref(q, cache, kv_b, meta, 0.3, nope, v)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    o_lat = mla_decode_attention(absorb_query(q_nope, kv_b), q_pe, cache, meta, 0.3, num_splits=splits,
                                 tiles=MLADecodeTiles(16, 32, 4, 2, keys_major))
    torch.testing.assert_close(unabsorb_output(o_lat, kv_b, nope), ref, atol=2e-5, rtol=2e-5)


@interpret
def test_expanded_prefill_kernel_matches_the_reference():
    """Whole prompts, chunks over a cached prefix and decode rows in one batch; ragged lengths
    across the kernel's tiles."""
    from ridge.kernels.mla_attention import mla_attention_ref
    from ridge.kernels.mla_prefill import mla_prefill_attention
    r, rope, nope, v = 32, 16, 32, 16
    q, cache, kv_b, meta = _decode_batch([37, 50, 19, 64, 1], 3, r, rope, nope, v, torch.float32,
                                         q_lens=[37, 21, 1, 40, 1])
    ref = mla_attention_ref(q, cache, kv_b, meta, 0.3, nope, v)
    torch.testing.assert_close(mla_prefill_attention(q, cache, kv_b, meta, 0.3, nope, v), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="qk_rope_head_dim=8"):
        mla_prefill_attention(q[..., :-8], cache[..., :-8], kv_b, meta, 0.3, nope, v)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_latent_write_kernel_matches_the_reference_and_skips_padding_slots(dtype):
    """The fused rotary + latent write: the rotated q_pe and the cache rows [latent, rotated k_pe] as
    the reference's (the kernel rounds the rotation once, so bf16 is held within a few ulps); the
    latent bits copied exactly; padding slots (negative) leave the cache alone. q_pe, latent and k_pe
    are strided views, as the projections hand them over."""
    from ridge.kernels.mla_attention import rope_write_latent, rope_write_latent_ref
    from ridge.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(1)
    T, H, r, rope = 6, 3, 32, 8
    rotary = RotaryEmbedding(rope, 64, 10000.0, None)
    q = torch.randn(T, H, 16 + rope, generator=g).to(dtype)
    kv_a = torch.randn(T, r + rope, generator=g).to(dtype)
    q_pe, latent, k_pe = q[..., 16:], kv_a[:, :r], kv_a[:, r:]
    positions = torch.tensor([0, 3, 17, 40, 63, 5])
    slots = torch.tensor([5, -1, 17, 40, -1, 0])
    a, b = (torch.randn(4, 16, 1, r + rope, generator=torch.Generator().manual_seed(2)).to(dtype) for _ in range(2))
    want = rope_write_latent_ref(positions, q_pe, latent, k_pe, rotary.cos, rotary.sin, a, slots)
    got = rope_write_latent(positions, q_pe, latent, k_pe, rotary.cos, rotary.sin, b, slots)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(b, a, **tol)
    assert torch.equal(b[..., :r], a[..., :r])                          # the latent: copied
    rows_a, rows_b = a.view(-1, r + rope), b.view(-1, r + rope)
    assert torch.equal(rows_b[17, :r], latent[2])
    untouched = torch.ones(rows_a.shape[0], dtype=torch.bool)
    untouched[[5, 17, 40, 0]] = False
    fresh = torch.randn(4, 16, 1, r + rope, generator=torch.Generator().manual_seed(2)).to(dtype).view(-1, r + rope)
    assert torch.equal(rows_b[untouched], fresh[untouched])
    with pytest.raises(ValueError, match="rope_write_latent"):
        rope_write_latent(positions, q_pe, latent, k_pe[:, :4], rotary.cos, rotary.sin, b, slots)
