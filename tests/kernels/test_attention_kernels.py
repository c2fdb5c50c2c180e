"""Triton attention kernels vs the pure-torch reference.

On CPU the kernels run under the Triton interpreter (set before triton is imported); the tests
marked `gpu` run the compiled kernels at real shapes in bf16.
"""
import os

import torch

# Without a GPU the kernels run in Triton's interpreter, which must be chosen before triton is
# imported; with one, they compile, and the CPU-tensor tests below are skipped.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import math  # noqa: E402

import pytest  # noqa: E402

from ridge.kernels.attention_meta import AttentionMetadata  # noqa: E402
from ridge.kernels.attention_ref import paged_attention_ref, write_kv_ref  # noqa: E402
from ridge.kernels.attention_triton import triton_paged_attention  # noqa: E402
from ridge.kernels.decode_attention import decode_attention  # noqa: E402
from ridge.kernels.prefill_attention import prefill_attention  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _cpu_tests_need_the_interpreter(request):
    if "gpu" not in request.keywords and not INTERPRET:
        pytest.skip("CPU-tensor kernel tests run under TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, page=16, dtype=torch.float32,
               device=CPU, seed=0, spare_pages=3):
    """Random paged layout: shuffled physical pages, NaN in every slot no sequence owns.

    Each sequence's prefix (ctx - q_len tokens) and its new tokens are written with write_kv_ref;
    returns q, k_cache, v_cache, meta and the new tokens' k, v.
    """
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [(c + page - 1) // page for c in ctx_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    max_pages = max(pages_per_seq + [1]) + 1  # one extra column of junk entries
    page_tables = torch.full((len(q_lens), max_pages), -1, dtype=torch.int32)
    k_cache = torch.full((num_pages, page, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    used, new_slots, new_k, new_v = 0, [], [], []
    for i, (ql, ctx) in enumerate(zip(q_lens, ctx_lens)):
        n = pages_per_seq[i]
        page_tables[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
        pos = torch.arange(ctx)
        slots = page_tables[i, pos // page].long() * page + pos % page
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        pre = ctx - ql
        write_kv_ref(k[:pre], v[:pre], k_cache, v_cache, slots[:pre])
        new_slots.append(slots[pre:])
        new_k.append(k[pre:])
        new_v.append(v[pre:])
    slot_mapping = torch.cat(new_slots)
    k_new, v_new = torch.cat(new_k).to(dtype), torch.cat(new_v).to(dtype)
    write_kv_ref(k_new, v_new, k_cache, v_cache, slot_mapping)
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        page_tables=page_tables.to(device),
        query_start_loc_cpu=starts, seq_lens_cpu=list(ctx_lens),
        max_query_len=max(q_lens), max_seq_len=max(ctx_lens))
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), meta, to(k_new), to(v_new)


def run_poisoned(fn, q, k_new, v_new, kc, vc, meta, scale, window=None, **kwargs):
    """Run a kernel into a NaN-filled output. The prefill kernel (and the dispatcher) also read
    the new tokens' contiguous k/v; the decode kernel reads everything from the cache."""
    out = torch.full_like(q, float("nan"))
    if fn is decode_attention:
        res = fn(q, kc, vc, meta, scale, window, out=out, **kwargs)
    else:
        res = fn(q, k_new, v_new, kc, vc, meta, scale, window, out=out, **kwargs)
    assert res is out
    assert not torch.isnan(out).any(), "kernel left output elements unwritten (or produced NaN)"
    return out


def check(q_lens, ctx_lens, heads, kv_heads, head_dim, fn, page=16, window=None, **kwargs):
    q, kc, vc, meta, k_new, v_new = make_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, page)
    scale = 1.0 / math.sqrt(head_dim)
    out = run_poisoned(fn, q, k_new, v_new, kc, vc, meta, scale, window, **kwargs)
    ref = paged_attention_ref(q, kc, vc, meta, scale, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# 1:1, 4:1, 8:1 (MQA). Prefill runs a program per query head and decode one per kv head, whatever the
# group: 1:1 at two heads runs the paths four did (a kv head past the first included) at half the programs
GQA = [(2, 2), (8, 2), (8, 1)]


# ---------------------------------------------------------------------------- prefill (interpreter)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_causal_varlen(heads, kv_heads, head_dim):
    lens = [37, 64, 5, 1, 33]
    check(lens, lens, heads, kv_heads, head_dim, prefill_attention)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
def test_prefill_chunked_with_prefix(heads, kv_heads):
    # chunks behind cached prefixes: page-aligned, unaligned, and a chunk longer than BLOCK_M
    check([20, 33, 16, 70], [50, 113, 32, 75], heads, kv_heads, 64, prefill_attention)


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (2, 2)])
def test_prefill_mixed_batch(heads, kv_heads):
    # decode rows (q_len 1, some with long contexts) next to prefill chunks
    check([1, 40, 1, 7, 1], [17, 100, 1, 30, 96], heads, kv_heads, 64, prefill_attention)


@pytest.mark.parametrize("page", [8, 32])
def test_prefill_other_page_sizes(page):
    check([30, 9], [70, 9], 4, 2, 64, prefill_attention, page=page)


def test_prefill_sliding_window():
    check([40, 1, 25], [90, 50, 25], 4, 2, 64, prefill_attention, window=19)
    check([40, 3], [40, 70], 4, 4, 64, prefill_attention, window=1)


def test_prefill_reads_new_kv_from_strided_views():
    """In the model, q/k/v are column slices of one QKV GEMM output: row stride > row width."""
    q, kc, vc, meta, k, v = make_batch([20, 35], [52, 35], 8, 2, 64)
    T = q.shape[0]
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    qv, kv_, vv = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    qv, kv_, vv = qv.view(T, 8, 64), kv_.view(T, 2, 64), vv.view(T, 2, 64)
    assert not kv_.is_contiguous()
    out = run_poisoned(prefill_attention, qv, kv_, vv, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, meta, 0.125), atol=1e-4, rtol=1e-4)


def test_prefill_head_dim_256():
    check([20, 1], [40, 23], 2, 1, 256, prefill_attention)


# ----------------------------------------------------------------------------- decode (interpreter)
DECODE_LENS = [1, 16, 45, 100, 129, 7]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_ragged(heads, kv_heads, head_dim):
    check([1] * len(DECODE_LENS), DECODE_LENS, heads, kv_heads, head_dim, decode_attention)


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_num_splits_and_workspace(num_splits):
    lens = [1, 45, 129, 16]
    q, kc, vc, meta, k_new, v_new = make_batch([1] * len(lens), lens, 8, 2, 64)
    n = len(lens) * 8 * num_splits
    ws = (torch.full((n * 64,), float("nan")), torch.full((n,), float("nan")))
    out = run_poisoned(decode_attention, q, k_new, v_new, kc, vc, meta, 0.125, num_splits=num_splits,
                       workspace=ws)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, meta, 0.125),
                               atol=1e-4, rtol=1e-4)


def test_decode_group_wider_than_16_and_hd256():
    check([1, 1], [40, 3], 32, 1, 64, decode_attention)   # MQA, 32 heads packed into M=32
    check([1, 1], [40, 17], 4, 2, 256, decode_attention)


def test_decode_sliding_window():
    check([1] * 4, [1, 20, 77, 130], 8, 2, 64, decode_attention, window=24)


def test_decode_page_size_32():
    check([1] * 3, [31, 33, 90], 4, 1, 64, decode_attention, page=32)


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_kernel_takes_verify_steps(heads, kv_heads):
    """A speculative verify step: each sequence's last few positions (k + 1 queries, fewer where a
    sequence drafted less, 0 for an idle slot), causal among themselves, packed with the group's
    heads into one program's rows; split over the context or not."""
    from ridge.kernels.decode_attention import choose_num_splits
    q_lens, lens = [6, 3, 0, 6, 1], [6, 70, 9, 133, 40]
    assert choose_num_splits(len(lens), kv_heads, max(lens), CPU) == 3    # what check's call splits in
    check(q_lens, lens, heads, kv_heads, 64, decode_attention)
    q, kc, vc, meta, k_new, v_new = make_batch(q_lens, lens, heads, kv_heads, 64, seed=3)
    out = run_poisoned(decode_attention, q, k_new, v_new, kc, vc, meta, 0.125, num_splits=1)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, meta, 0.125), atol=1e-4, rtol=1e-4)


def test_decode_verify_step_with_a_sliding_window_and_its_limits():
    check([4, 2, 4], [30, 77, 9], 8, 2, 64, decode_attention, window=5)
    # the window over several splits: a later query's keys start in a later split than the first's
    check([8, 1, 0, 5], [90, 77, 9, 140], 8, 2, 64, decode_attention, window=40, num_splits=3)
    from ridge.kernels.decode_attention import MAX_QUERIES, fits_decode
    assert fits_decode(MAX_QUERIES, 16) and not fits_decode(MAX_QUERIES + 1, 1) and not fits_decode(8, 32)


# ----------------------------------------------------------------------------------- dispatch, misc
def test_dispatch_decode_and_mixed():
    check([1] * 3, [5, 60, 17], 8, 2, 64, triton_paged_attention)
    check([1, 12, 1], [5, 60, 17], 8, 2, 64, triton_paged_attention)
    # q_len 0 slots (padding / idle sequences) produce no rows and must not disturb the others
    check([1, 0, 1], [5, 9, 40], 8, 2, 64, triton_paged_attention)
    check([0, 9, 1, 0], [3, 60, 17, 20], 8, 2, 64, triton_paged_attention)


def test_unsupported_inputs_raise():
    q, kc, vc, meta, k, v = make_batch([3], [3], 2, 1, 48)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(q, k, v, kc, vc, meta, 0.1)
    q, kc, vc, meta, k, v = make_batch([2], [5], 2, 1, 64)
    with pytest.raises(ValueError, match="sliding_window"):
        prefill_attention(q, k, v, kc, vc, meta, 0.1, sliding_window=0)
    with pytest.raises(ValueError, match="new k"):
        prefill_attention(q, k[:1], v[:1], kc, vc, meta, 0.1)
    q, kc, vc, meta, k, v = make_batch([9], [20], 2, 1, 64)
    with pytest.raises(ValueError, match="max_query_len 9"):
        decode_attention(q, kc, vc, meta, 0.1)


# ------------------------------------------------------------------------------- GPU, real shapes
def gpu_check(q_lens, ctx_lens, heads, kv_heads, head_dim, fn, seed, window=None):
    dev = torch.device("cuda")
    q, kc, vc, meta, k_new, v_new = make_batch(q_lens, ctx_lens, heads, kv_heads, head_dim,
                                               dtype=torch.bfloat16, device=dev, seed=seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = run_poisoned(fn, q, k_new, v_new, kc, vc, meta, scale, window)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale, sliding_window=window)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= 1e-2, rel


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 32, 8), (64, 16, 16), (256, 8, 1)])
def test_gpu_prefill_bf16(head_dim, heads, kv_heads):
    seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs every run
    gpu_check([1024, 513, 1, 2000, 77], [1024, 1513, 4001, 2000, 3077], heads, kv_heads,
              head_dim, triton_paged_attention, seed)
    gpu_check([300, 1], [2300, 900], heads, kv_heads, head_dim, prefill_attention, seed, window=512)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lens", [[32768], [4096] * 32, [1, 15, 16, 17, 999, 8192, 2048, 300] * 8])
def test_gpu_decode_bf16(lens):
    seed = int(torch.randint(0, 2**31, ()).item())
    gpu_check([1] * len(lens), lens, 32, 8, 128, triton_paged_attention, seed)
    gpu_check([1] * len(lens), lens, 32, 8, 128, decode_attention, seed, window=1000)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (64, 8)])
def test_gpu_verify_steps_on_the_decode_kernel(heads, kv_heads):
    """Speculative verify steps (k + 1 = 6 queries a sequence, some fewer) through the dispatcher,
    which gives them to the decode kernel, at the 8B and 70B head counts."""
    seed = int(torch.randint(0, 2**31, ()).item())
    gpu_check([6, 6, 3, 6], [1030, 6, 4001, 300], heads, kv_heads, 128, triton_paged_attention, seed)
    gpu_check([6] * 16, [2048] * 16, heads, kv_heads, 128, decode_attention, seed, window=1000)
