"""Micro-batches for the overlapped all-reduce (ridge/models/overlap.py): the attention metadata of
a range of a batch's tokens (token_slice) against the metadata built for that range directly, and
attention run as two micro-batches - the first's K/V written before the second attends - against
the batch run whole, on the torch and the Triton backends; where a step is cut."""
import os
from types import SimpleNamespace

import torch

# the Triton kernels run in the interpreter without a GPU; it must be chosen before triton is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ridge.kernels.attention_meta import token_slice  # noqa: E402
from ridge.kernels.attention_ref import paged_attention_ref, write_kv_ref  # noqa: E402
from ridge.kernels.attention_triton import triton_paged_attention  # noqa: E402
from ridge.models.overlap import OVERLAP_MIN_TOKENS, overlap_cut  # noqa: E402
from ridge.parallel import TensorParallel  # noqa: E402
from ridge.runner.model_runner import ModelRunner  # noqa: E402

PAGE = 4
HOST = SimpleNamespace(to_device=lambda values, dtype: torch.tensor(values, dtype=dtype))


def prefill_meta(q_lens, ctx_lens, tables):
    """The runner's metadata of a flat batch (ModelRunner.metadata, host lists on the CPU): each
    sequence's q_len new rows are the last of its ctx_len positions."""
    starts, slots = [0], []
    for q, c, t in zip(q_lens, ctx_lens, tables):
        starts.append(starts[-1] + q)
        slots += [t[p // PAGE] * PAGE + p % PAGE for p in range(c - q, c)]
    return ModelRunner.metadata(HOST, slots, starts, list(ctx_lens), tables)


def batch(q_lens, ctx_lens):
    """Page tables of distinct pages, shuffled."""
    perm = torch.randperm(sum(-(-c // PAGE) for c in ctx_lens), generator=torch.Generator().manual_seed(0)).tolist()
    tables, used = [], 0
    for c in ctx_lens:
        n = -(-c // PAGE)
        tables.append(perm[used:used + n])
        used += n
    return tables


def clipped(q_lens, ctx_lens, tables, lo, hi):
    """The range [lo, hi) of the batch as the runner would plan it on its own: each sequence's rows
    inside the range, its context ending at the last of them."""
    out, start = ([], [], []), 0
    for q, c, t in zip(q_lens, ctx_lens, tables):
        a, b = max(start, lo), min(start + q, hi)
        if a < b:
            for lst, v in zip(out, (b - a, c - (start + q - b), t)):
                lst.append(v)
        start += q
    return out


# a prefill with a cached prefix, a decode row, a fresh prompt; the cuts: at a boundary, inside a
# sequence, around the decode row, one sequence in halves
CASES = [((5, 12, 1, 9), (5, 20, 30, 9), [(0, 17), (17, 27), (0, 11), (11, 27), (16, 19), (3, 26)]),
         ((40,), (40,), [(0, 20), (20, 40)]),
         ((30,), (50,), [(0, 13), (13, 30)])]


@pytest.mark.parametrize("q_lens, ctx_lens, ranges", CASES)
def test_token_slice_is_the_metadata_of_the_range(q_lens, ctx_lens, ranges):
    tables = batch(q_lens, ctx_lens)
    meta = prefill_meta(q_lens, ctx_lens, tables)
    for lo, hi in ranges:
        got, want = token_slice(meta, lo, hi), prefill_meta(*clipped(q_lens, ctx_lens, tables, lo, hi))
        width = want.page_tables.shape[1]
        assert torch.equal(got.page_tables[:, :width], want.page_tables)
        assert not got.page_tables[:, width:].any()              # the rest is the padding (page 0)
        for f in ("slot_mapping", "query_start_loc", "seq_lens"):
            assert getattr(got, f).dtype == getattr(want, f).dtype and torch.equal(getattr(got, f), getattr(want, f)), f
        for f in ("query_start_loc_cpu", "seq_lens_cpu", "max_query_len", "max_seq_len"):
            assert getattr(got, f) == getattr(want, f), f
    with pytest.raises(ValueError, match="token_slice"):
        token_slice(meta, 3, 3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("q_lens, ctx_lens, ranges", CASES)
def test_attention_in_micro_batches_matches_the_whole_batch(backend, q_lens, ctx_lens, ranges):
    """Micro-batches in order, each writing its new K/V before it attends (what a layer does): the
    outputs of the batch run whole. The prefill kernel reads a micro-batch's own rows from k, v
    and everything before them, an earlier micro-batch's rows included, from the cache."""
    heads, kv_heads, d = 4, 2, 16
    g = torch.Generator().manual_seed(1)
    tables = batch(q_lens, ctx_lens)
    meta = prefill_meta(q_lens, ctx_lens, tables)
    T, pages = sum(q_lens), sum(map(len, tables))
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    attend = triton_paged_attention if backend == "triton" else \
        lambda q, k, v, kc, vc, m, s: paged_attention_ref(q, kc, vc, m, s)   # the reference reads the cache only

    def fresh_cache():
        """The cached prefixes written; the new rows' slots NaN until their micro-batch writes them."""
        kc, vc = (torch.full((pages, PAGE, kv_heads, d), float("nan")) for _ in range(2))
        for c, qn, t in zip(ctx_lens, q_lens, tables):
            pos = torch.arange(c - qn)
            slots = torch.tensor(t)[pos // PAGE] * PAGE + pos % PAGE
            old_k, old_v = (torch.randn(len(pos), kv_heads, d, generator=torch.Generator().manual_seed(c + i))
                            for i in (0, 1))
            write_kv_ref(old_k, old_v, kc, vc, slots)
        return kc, vc

    kc, vc = fresh_cache()
    write_kv_ref(k, v, kc, vc, meta.slot_mapping)
    whole = attend(q, k, v, kc, vc, meta, d ** -0.5)
    for cut in sorted({hi for _, hi in ranges if 0 < hi < T}):
        kc, vc = fresh_cache()
        parts = []
        for lo, hi in ((0, cut), (cut, T)):
            m = token_slice(meta, lo, hi)
            write_kv_ref(k[lo:hi], v[lo:hi], kc, vc, m.slot_mapping)
            parts.append(attend(q[lo:hi], k[lo:hi], v[lo:hi], kc, vc, m, d ** -0.5))
        torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_where_a_step_is_cut():
    two, x = TensorParallel(0, 2), torch.empty(0)
    n = OVERLAP_MIN_TOKENS

    def cut(q_lens, tp=two):
        return overlap_cut(prefill_meta(q_lens, q_lens, [[0] * -(-q // PAGE) for q in q_lens]), tp, x)
    assert cut([n // 2, n // 2 + 8]) == n // 2                       # whole sequences, the nearest boundary
    assert cut([n // 4, n // 4, n // 2 + 6, 2]) == n // 2
    assert cut([n - 4, 4]) == n // 2                                 # one sequence nearly all: its halves
    assert cut([n]) == n // 2
    assert cut([n - 1]) is None                                      # too few tokens to pay
    assert cut([n], TensorParallel()) is None                        # one rank: nothing to overlap
