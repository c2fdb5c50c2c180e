"""The page allocator on its own: ref counts, prefix hits, copy-on-write, eviction."""
import pytest

from ridge.engine.pages import PageAllocator
from ridge.engine.request import Request, Sequence
from ridge.engine.sampling_params import SamplingParams


def seq(tokens, sid=0):
    req = Request(f"r{sid}", None, list(tokens), SamplingParams(), 8)
    return Sequence(sid, req, 0, list(tokens), len(tokens), seed=0)


def computed_seq(bm, tokens):
    """A sequence whose tokens all sit in the cache, its full pages offered for prefix hits."""
    s = seq(tokens)
    bm.allocate(s, len(s.token_ids))
    s.num_computed_tokens = len(s.token_ids)
    bm.register_full_pages(s)
    return s


def test_allocate_free_and_refcounts():
    bm = PageAllocator(8, 4, enable_prefix_caching=True)
    s = seq(range(10))
    assert bm.pages_needed(s, 10) == 3
    bm.allocate(s, 10)
    assert len(s.page_table) == 3 and bm.num_free_pages == 5
    bm.free(s)
    assert bm.num_free_pages == 8 and all(c == 0 for c in bm.ref_counts)
    with pytest.raises(RuntimeError):
        bm._unref(0)


def test_prefix_hits_leave_one_token_and_survive_free():
    bm = PageAllocator(8, 4, enable_prefix_caching=True)
    a = computed_seq(bm, range(12))
    pages = list(a.page_table)
    bm.free(a)
    b = seq(range(12), sid=1)
    hits = bm.match_prefix(b)
    assert hits == pages[:2]                    # the third page would leave nothing to compute
    assert bm.pages_needed(b, 4, hits) == 1 + 2  # one new page + two hits taken out of the free queue
    bm.take_hits(b, hits)
    assert b.num_computed_tokens == 8 and bm.ref_counts[pages[0]] == 1
    c = seq(list(range(4)) + [99] * 8, sid=2)
    assert bm.match_prefix(c) == pages[:1]      # chained hash: only the common first page


def test_prefix_cache_counts_the_tokens_looked_up_and_hit():
    bm = PageAllocator(8, 4, enable_prefix_caching=True)
    bm.free(computed_seq(bm, range(12)))
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (0, 0)
    b = seq(range(12), sid=1)
    bm.take_hits(b, bm.match_prefix(b))
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (12, 8)
    c = seq(range(12), sid=2)
    bm.take_hits(c, [], looked_up=False)        # scored prompts (prompt_logprobs) skip the cache
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (12, 8)
    off = PageAllocator(8, 4, enable_prefix_caching=False)
    off.take_hits(seq(range(12)), [])
    assert (off.prefix_query_tokens, off.prefix_hit_tokens) == (0, 0)


def test_fork_and_copy_on_write():
    bm = PageAllocator(8, 4, enable_prefix_caching=False)
    p = seq(range(6))
    bm.allocate(p, 6)
    p.num_computed_tokens = 6
    child = seq(range(6), sid=1)
    bm.fork(p, child)
    assert bm.ref_counts[p.page_table[1]] == 2
    p.token_ids.append(50)
    assert bm.pages_needed(p, 1) == 1
    bm.allocate(p, 1)
    assert bm.take_pending_copies() == [(child.page_table[1], p.page_table[1])]
    assert bm.ref_counts[child.page_table[1]] == 1 and bm.ref_counts[p.page_table[0]] == 2
    bm.free(p)
    bm.free(child)
    assert bm.num_free_pages == 8


def test_reused_page_is_evicted_from_the_cache():
    bm = PageAllocator(2, 4, enable_prefix_caching=True)
    a = computed_seq(bm, range(8))
    bm.free(a)
    assert len(bm.cached) == 2
    b = seq([7] * 8, sid=1)
    bm.allocate(b, 8)
    assert len(bm.cached) == 0
