"""Attention over an FP8 KV cache (ridge/kernels/kv_fp8.py) vs the reference on its dequantized values.

The kernels dequantize in registers, exactly (e4m3 x 2^e is exact in bf16 and fp32), so an FP8
cache must give what the same kernels give on the dequantized cache: the tolerances are those of
tests/kernels/test_attention_kernels.py. The quantization error itself (FP8 vs the bf16 values before
quantization) is a quality figure, reported by benchmarks/kernels/attention.py --kv-cache-dtype fp8.
"""
import math

import pytest
import torch

# test_attention_kernels chooses the interpreter before triton is imported: import it first
from tests.kernels import test_attention_kernels as kernel_tests
from tests.kernels.test_attention_kernels import CPU, make_batch, needs_gpu, run_poisoned

from ridge.kernels.attention_ref import paged_attention_ref, write_kv_ref
from ridge.kernels.attention_triton import triton_paged_attention
from ridge.kernels.decode_attention import decode_attention
from ridge.kernels.kv_fp8 import FP8, dequantize_rows_ref, quantize_rows_ref
from ridge.kernels.prefill_attention import prefill_attention

OUTLIERS = (3, 17, 40)       # channels scaled up, as real keys have a few (they set the row's scale)
NO_ROW = 255                 # scale byte of slots no sequence owns: 2^128 -> inf, poison if read
_cpu_tests_need_the_interpreter = kernel_tests._cpu_tests_need_the_interpreter   # its autouse skip rule


def owned_slots(meta, page):
    """Every cache slot some sequence's context occupies."""
    slots = []
    for i, ctx in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(ctx, device=meta.page_tables.device)
        slots.append(meta.page_tables[i, pos // page].long() * page + pos % page)
    return torch.cat(slots)


def make_fp8_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, page=16, dtype=torch.float32,
                   device=CPU, seed=0, strided_scales=False):
    """make_batch's layout with K/V given outlier channels, written into an FP8 cache by write_kv_ref.

    Returns q, the FP8 caches, their scales, the dequantized caches (q's dtype; NaN where no
    sequence owns a slot), meta, and the new tokens' dequantized k, v (what the KV-write kernel
    hands to attention). With strided_scales the scales are [kvh, pages, page] storage seen as
    [pages, page, kvh]: non-contiguous, so the kernels' scale strides are exercised.
    """
    q, kc, vc, meta, _, _ = make_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, page, dtype=dtype,
                                       device=device, seed=seed)
    kc[..., list(OUTLIERS)] *= 20.0
    vc[..., OUTLIERS[0]] *= 12.0
    slots = owned_slots(meta, page)
    caches, scales = [], []
    for c in (kc, vc):
        caches.append(c.to(FP8))                   # NaN rows stay NaN; owned rows are rewritten
        if strided_scales:
            s = torch.full((kv_heads, *c.shape[:2]), NO_ROW, dtype=torch.uint8, device=device).permute(1, 2, 0)
        else:
            s = torch.full(c.shape[:3], NO_ROW, dtype=torch.uint8, device=device)
        scales.append(s)
    rows = lambda c: c.view(-1, kv_heads, head_dim)[slots]  # noqa: E731
    write_kv_ref(rows(kc), rows(vc), *caches, slots, tuple(scales))
    deq = [dequantize_rows_ref(c, s, dtype) for c, s in zip(caches, scales)]
    new = [d.view(-1, kv_heads, head_dim)[meta.slot_mapping] for d in deq]
    return q, caches, tuple(scales), deq, meta, new


def check_fp8(q_lens, ctx_lens, heads, kv_heads, head_dim, fn, page=16, window=None, **kwargs):
    q, (kq, vq), scales, (kd, vd), meta, (k_new, v_new) = make_fp8_batch(
        q_lens, ctx_lens, heads, kv_heads, head_dim, page, strided_scales=kwargs.pop("strided_scales", False))
    scale = 1.0 / math.sqrt(head_dim)
    out = run_poisoned(fn, q, k_new, v_new, kq, vq, meta, scale, window, kv_scales=scales, **kwargs)
    ref = paged_attention_ref(q, kd, vd, meta, scale, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_on_fp8_cache_is_reference_on_dequantized_cache(dtype):
    q, (kq, vq), scales, _, meta, _ = make_fp8_batch([1, 30, 1, 9], [40, 50, 1, 9], 8, 2, 64,
                                                     dtype=dtype, strided_scales=True)
    kd, vd = (dequantize_rows_ref(c, s, torch.bfloat16) for c, s in zip((kq, vq), scales))
    for window in (None, 7):
        out = paged_attention_ref(q, kq, vq, meta, 0.125, window, kv_scales=scales)
        assert out.dtype == dtype
        assert torch.equal(out, paged_attention_ref(q, kd, vd, meta, 0.125, window))


def test_write_kv_ref_round_trips():
    g = torch.Generator().manual_seed(1)
    pages, page, kvh, d = 6, 16, 2, 64
    k = torch.randn(20, kvh, d, generator=g).to(torch.bfloat16)
    v = torch.randn(20, kvh, d, generator=g).to(torch.bfloat16)
    k[..., list(OUTLIERS)] *= 50.0
    k[3, 1] = 0.0                                      # an all-zero row: the smallest scale, zeros back
    v[5, 0] *= 1e-30                                   # tiny rows keep their relative precision
    slots = torch.randperm(pages * page, generator=g)[:20]
    kq = torch.zeros(pages, page, kvh, d, dtype=FP8)
    vq = torch.zeros_like(kq)
    ks = torch.full((pages, page, kvh), NO_ROW, dtype=torch.uint8)
    vs = ks.clone()
    write_kv_ref(k, v, kq, vq, slots, (ks, vs))
    for x, c, s in ((k, kq, ks), (v, vq, vs)):
        got = dequantize_rows_ref(c.view(-1, kvh, d)[slots], s.view(-1, kvh)[slots], torch.bfloat16)
        assert torch.equal(got, dequantize_rows_ref(*quantize_rows_ref(x), torch.bfloat16))
        others = torch.ones(pages * page, dtype=torch.bool)
        others[slots] = False
        assert (s.view(-1, kvh)[others] == NO_ROW).all() and (c.view(-1, kvh, d)[others].float() == 0).all()
    assert (dequantize_rows_ref(kq.view(-1, kvh, d)[slots[3], 1], ks.view(-1, kvh)[slots[3], 1],
                                torch.float32) == 0).all()
    tiny = dequantize_rows_ref(vq.view(-1, kvh, d)[slots[5], 0], vs.view(-1, kvh)[slots[5], 0], torch.float32)
    assert ((tiny - v[5, 0].float()).abs() <= v[5, 0].float().abs() / 8).all()   # e4m3: 3 mantissa bits


# ---------------------------------------------------------------------------- kernels (interpreter)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1), (2, 2)])
def test_decode_fp8(heads, kv_heads):
    check_fp8([1] * 5, [1, 16, 45, 100, 129], heads, kv_heads, 64, decode_attention)


def test_decode_fp8_strided_scales_splits_and_window():
    lens = [1, 20, 77, 130]
    check_fp8([1] * 4, lens, 8, 2, 64, decode_attention, strided_scales=True, num_splits=2)
    check_fp8([1] * 4, lens, 8, 2, 64, decode_attention, window=24, num_splits=1)


def test_decode_fp8_verify_step():
    """A verify step's few queries a sequence over an FP8 cache, split over the context and not."""
    lens = [20, 77, 9, 140]
    check_fp8([6, 1, 0, 4], lens, 8, 2, 64, decode_attention, num_splits=3)
    check_fp8([6, 1, 0, 4], lens, 8, 2, 64, decode_attention, window=30, num_splits=1)


def test_decode_fp8_head_dim_128_page_32():
    check_fp8([1] * 3, [31, 33, 90], 4, 1, 128, decode_attention, page=32)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (2, 2)])
def test_prefill_fp8_mixed_batch(heads, kv_heads):
    # prefix-cache hits behind chunks (page-aligned and not), plain prefills, decode rows
    check_fp8([1, 40, 1, 7, 20, 16], [17, 100, 1, 30, 20, 48], heads, kv_heads, 64, prefill_attention)


def test_prefill_fp8_sliding_window_and_strided_scales():
    check_fp8([40, 1, 25], [90, 50, 25], 4, 2, 64, prefill_attention, window=19, strided_scales=True)


def test_dispatch_fp8():
    check_fp8([1] * 3, [5, 60, 17], 8, 2, 64, triton_paged_attention)
    check_fp8([1, 12, 0, 1], [5, 60, 9, 17], 8, 2, 64, triton_paged_attention)


def test_16_bit_q_dequantizes_to_its_dtype():
    """q in fp16: the tiles are dequantized to fp16 and the dots run in 16 bits, as bf16 does on
    the GPU (the interpreter's bf16 dots are wrong even without FP8; the GPU tests cover bf16)."""
    for q_lens, ctx_lens, fns in (([1, 20], [40, 20], (prefill_attention, triton_paged_attention)),
                                  ([1, 1], [40, 7], (decode_attention,))):
        q, (kq, vq), scales, (kd, vd), meta, (k_new, v_new) = make_fp8_batch(
            q_lens, ctx_lens, 4, 2, 64, dtype=torch.float16)
        ref = paged_attention_ref(q.float(), kd.float(), vd.float(), meta, 0.125)
        for fn in fns:
            out = run_poisoned(fn, q, k_new, v_new, kq, vq, meta, 0.125, kv_scales=scales)
            assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


def test_bad_kv_scales_raise():
    q, (kq, vq), (ks, vs), (kd, vd), meta, (k, v) = make_fp8_batch([1, 1], [9, 20], 4, 2, 64)
    calls = {"ref": lambda c, s: paged_attention_ref(q, *c, meta, 0.1, kv_scales=s),
             "decode": lambda c, s: decode_attention(q, *c, meta, 0.1, kv_scales=s),
             "prefill": lambda c, s: prefill_attention(q, k, v, *c, meta, 0.1, kv_scales=s),
             "write": lambda c, s: write_kv_ref(k, v, *c, meta.slot_mapping, s)}
    cases = [((kq, vq), None, "needs kv_scales"),
             ((kq, vq), (ks,), "pair"),
             ((kq, vq), (ks, vs.float()), "v_scale must be uint8"),
             ((kq, vq), (ks[:, :8], vs), r"k_scale shape \(\d+, 8, 2\)"),
             ((kq, vq), (ks.transpose(1, 2), vs), "k_scale shape"),
             ((kd, vd), (ks, vs), "only an FP8 cache"),
             ((kq, vd), (ks, vs), "both be FP8")]
    for caches, scales, problem in cases:
        for name, call in calls.items():
            with pytest.raises(ValueError, match=problem):
                call(caches, scales)


# ------------------------------------------------------------------------------- GPU, real shapes
def gpu_check_fp8(q_lens, ctx_lens, fn, seed, window=None, heads=32, kv_heads=8, head_dim=128):
    q, (kq, vq), scales, (kd, vd), meta, (k_new, v_new) = make_fp8_batch(
        q_lens, ctx_lens, heads, kv_heads, head_dim, dtype=torch.bfloat16, device=torch.device("cuda"), seed=seed)
    scale = 1.0 / math.sqrt(head_dim)
    out = run_poisoned(fn, q, k_new, v_new, kq, vq, meta, scale, window, kv_scales=scales)
    ref = paged_attention_ref(q.float(), kd.float(), vd.float(), meta, scale, sliding_window=window)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= 1e-2, rel


@pytest.mark.gpu
@needs_gpu
def test_gpu_decode_fp8_llama8b():
    seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs every run
    lens = [4096] * 8 + [1, 15, 16, 17, 999, 2048, 300, 4095]
    gpu_check_fp8([1] * len(lens), lens, decode_attention, seed)
    gpu_check_fp8([1] * len(lens), lens, triton_paged_attention, seed, window=1000)


@pytest.mark.gpu
@needs_gpu
def test_gpu_prefill_fp8_llama8b():
    seed = int(torch.randint(0, 2**31, ()).item())
    gpu_check_fp8([1024, 513, 1, 77, 1], [4096, 1513, 4001, 3077, 4096], triton_paged_attention, seed)
    gpu_check_fp8([300, 1], [2300, 900], prefill_attention, seed, window=512)


# ------------------------------------------------------------------------- the benchmark's plan
def test_benchmark_plan_and_fp8_layout(monkeypatch):
    from tests.tests_support import load_benchmark
    b = load_benchmark("attention")
    monkeypatch.delenv("OUT", raising=False)
    assert b.decode_plan(b.parse_args([])) == list(b.DECODE_SHAPES)
    args = b.parse_args(["--kv-cache-dtype", "fp8", "--decode-shapes", "1x32768", "32X4096"])
    assert b.decode_plan(args) == [(1, 32768), (32, 4096), (128, 2048)]    # the targets always run
    assert b.decode_plan(b.parse_args(["--kv-cache-dtype", "both"])) == list(b.DECODE_SHAPES)
    for bad in ("32", "0x4096", "4x100", "ax16"):
        with pytest.raises(SystemExit):
            b.parse_args(["--decode-shapes", bad])
    # the FP8 rows and their scale bytes land on the same pages, where the page table says
    k = torch.randn(2, 3, 4 * b.PAGE, 8)
    kq, ks = quantize_rows_ref(k)
    k_cache, v_cache, kq_cache, ks_cache, bt, slots = b.paged_from_contiguous(k, k, kq, ks)
    assert kq_cache.dtype == FP8 and ks_cache.shape == kq_cache.shape[:3] == k_cache.shape[:3]
    pos = torch.arange(4 * b.PAGE)
    for i in range(2):
        page, row = bt[i, pos // b.PAGE].long(), pos % b.PAGE
        assert torch.equal(k_cache[page, row], k[i].transpose(0, 1))
        assert torch.equal(kq_cache[page, row].view(torch.uint8), kq[i].transpose(0, 1).view(torch.uint8))
        assert torch.equal(ks_cache[page, row], ks[i].transpose(0, 1))
