"""The INT4 dequant path (ridge/kernels/int4_dequant.py, ridge/layers/quant/int4/dispatch.py): the
16-bit weight the Triton pass writes is the reference's, bit for bit (TRITON_INTERPRET=1 on the CPU);
the dispatch times both paths per bucket and keeps the faster, cached; an INT4 Linear takes the
dequant path only where its table says so, and its cost then states the dequant pass before
the GEMM; the shared 16-bit weight buffer."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ridge.kernels.int4_dequant import int4_dequantize  # noqa: E402
from ridge.kernels.int4_matmul import dequantize_int4, groups_of, int4_matmul_ref  # noqa: E402
from ridge.layers.quant.int4 import dispatch as int4_dispatch  # noqa: E402
from ridge.layers.quant.int4.dispatch import MIN_ROWS, dispatch_table, path_for  # noqa: E402


def tables(K, N, G, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qw = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=gen)
    s = (torch.rand(groups_of(K, G), N, generator=gen) * 0.02 + 1e-3).to(dtype)
    z = torch.randint(0, 16, (groups_of(K, G), N), generator=gen).to(dtype)
    return qw, s, z


@pytest.mark.parametrize("K,N,G,dtype", [(256, 200, 128, torch.bfloat16), (200, 72, 64, torch.float16),
                                         (320, 40, 128, torch.bfloat16), (96, 33, 32, torch.bfloat16),
                                         (136, 16, 136, torch.float16)],
                         ids=["g128", "g64-fp16-tail", "short-last-group", "g32-odd-n", "g=k"])
def test_dequantize_is_the_references_weight_bit_for_bit(K, N, G, dtype):
    qw, s, z = tables(K, N, G, dtype)
    want = dequantize_int4(qw, s, z, G).to(dtype)       # (q - z) * s exact in fp32, rounded once
    assert torch.equal(int4_dequantize(qw, s, z, G), want)
    out = torch.full((K, N), float("nan"), dtype=dtype)
    assert int4_dequantize(qw, s, z, G, out=out) is out and torch.equal(out, want)


def test_dequantize_without_the_interpreter_and_its_errors(monkeypatch):
    qw, s, z = tables(64, 24, 32, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # the knob reads it per call (setting the knob would pin it)
    assert torch.equal(int4_dequantize(qw, s, z, 32), dequantize_int4(qw, s, z, 32).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be a contiguous \[64, 24\]"):
        int4_dequantize(qw, s, z, 32, out=torch.empty(24, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        int4_dequantize(qw, s, z, 32, out=torch.empty(64, 24, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 8"):
        int4_dequantize(qw, s, z, 12)


def test_dispatch_times_both_paths_per_bucket_keeps_the_faster_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    # the paths run on the CPU's torch fallbacks, not interpreted: what is checked here is the timing,
    # the choice and the cache; the kernels' products are checked in test_int4_kernels.py and above
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # the knobs read it per call
    timed = []

    def fake_time(fn, bound_us=float("inf")):    # the INT4 GEMM grows with the batch faster than cuBLAS does
        y = fn()
        m, dequant = y.shape[0], bound_us != float("inf")
        timed.append((m, dequant))
        return 50.0 + m * 0.05 if dequant else 10.0 + m * 0.1
    monkeypatch.setattr(int4_dispatch, "graph_time_us", fake_time)
    qw, s, z = tables(64, 16, 32, torch.bfloat16)
    paths = dispatch_table(qw, s, z, 32)
    assert set(paths) == set(int4_dispatch.BUCKETS) and min(paths) == MIN_ROWS
    assert all(p == ("dequant" if m > 800 else "int4") for m, p in paths.items())
    assert sorted(timed) == sorted((m, d) for m in int4_dispatch.BUCKETS for d in (False, True))
    assert len(list((tmp_path / "int4").iterdir())) == 1
    timed.clear()
    assert dispatch_table(qw, s, z, 32) == paths and not timed              # the second start reads the cache
    # where a batch goes: no table and a skinny batch keep the INT4 kernels; past the last bucket, its choice
    assert path_for(None, 4096) == "int4" and path_for(paths, MIN_ROWS - 1) == "int4"
    assert path_for(paths, 1000) == "dequant" and path_for(paths, 100_000) == "dequant"
    assert path_for(paths, 300) == "int4"


def test_a_dequant_path_that_runs_out_of_memory_is_recorded_and_not_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))

    def fake_time(fn, bound_us=float("inf")):          # the INT4 kernels time; the 16-bit weight does not fit
        if bound_us != float("inf"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 896.00 MiB")
        return 1.0
    monkeypatch.setattr(int4_dispatch, "graph_time_us", fake_time)
    qw, s, z = tables(64, 16, 32, torch.bfloat16)
    paths = dispatch_table(qw, s, z, 32)
    assert set(paths.values()) == {"int4"}
    cached = next((tmp_path / "int4").iterdir()).read_text()
    assert "OutOfMemoryError" in cached and "896.00 MiB" in cached


def test_an_int4_linear_takes_the_dequant_path_where_its_table_says(monkeypatch):
    from ridge.layers.cost import Precision, StepShape
    from ridge.layers.linear import Linear
    from ridge.layers.quant.int4 import linear as int4
    from ridge.layers.quant.int4.config import Int4Config
    calls = []
    monkeypatch.setattr(int4, "dequant_matmul", lambda *a: calls.append(a[0].shape[0]) or int4_dispatch.dequant_matmul(*a))
    layer = Linear(256, 96, quant=Int4Config("int4", 128))
    layer.initialize_dummy(torch.Generator().manual_seed(1), 0.02)
    method = layer.quant_method
    qw, s, z = (method.table(layer, r) for r in ("qweight", "scales", "zeros"))
    s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
    for role, t in (("scales", s), ("zeros", z)):
        getattr(layer, method.names[role]).data = t
    x = torch.randn(MIN_ROWS + 36, 256).to(torch.bfloat16)
    assert method.paths is None                                  # on the CPU: no table, the INT4 path
    y_int4 = layer(x)
    method.set_paths(layer, {m: "dequant" for m in int4_dispatch.BUCKETS})
    assert method.workspace.buffer.numel() >= 256 * 96
    assert not calls and layer(x[:MIN_ROWS - 1]) is not None and not calls     # skinny: the INT4 kernels still
    y = layer(x)
    assert calls == [MIN_ROWS + 36]
    torch.testing.assert_close(y.float(), int4_matmul_ref(x, qw, s, z, 128).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), y_int4.float(), atol=2e-2, rtol=2e-2)
    act = Precision("bf16", 2, compute="bf16")
    assert method.precision(act, MIN_ROWS + 36).bytes == 2                     # the GEMM reads the 16-bit weight
    assert method.precision(act, 1).bytes == pytest.approx(0.5 + 4 / 128)    # a decode batch: the INT4 GEMV's
    # the cost: the dequant pass (tables in, 16-bit weight out) as its own op before the GEMM, whose
    # weight is that pass's output rather than a parameter; a decode step: one GEMM on the tables
    rows, w = MIN_ROWS + 36, 256 * 96
    dequant, gemm = layer.cost(StepShape((rows,), (rows,)))
    assert (dequant.name, gemm.kind) == ("int4_dequant", "gemm") and dequant.flops == 2 * w
    tables = w * (0.5 + 4 / 128)
    assert dequant.bytes == pytest.approx(tables + 2 * w) and dequant.param_bytes == pytest.approx(tables)
    assert gemm.param_bytes == 0 and gemm.bytes == pytest.approx(w * 2 + rows * (256 + 96) * 2)
    (decode,) = layer.cost(StepShape((1,), (9,)))
    assert decode.param_bytes == pytest.approx(tables)


def test_the_dequant_workspace_is_one_buffer_the_largest_layer_long():
    """Layers of one device and dtype share one 16-bit weight, grown to the largest while loading; a
    growth after a CUDA graph captured it is an error (the graph would write into freed memory); it
    goes when its last layer does."""
    from ridge.layers.quant.int4.dispatch import DequantWorkspace
    small = DequantWorkspace.shared(torch.device("cpu"), torch.float16, 64 * 32)
    large = DequantWorkspace.shared(torch.device("cpu"), torch.float16, 128 * 64)
    assert small is large and large.buffer.numel() == 128 * 64
    assert large.weight(64, 32).shape == (64, 32) and large.weight(64, 32).data_ptr() == large.buffer.data_ptr()
    assert DequantWorkspace.shared(torch.device("cpu"), torch.bfloat16, 8) is not large     # another dtype
    large.captured = True
    assert DequantWorkspace.shared(torch.device("cpu"), torch.float16, 128 * 64) is large   # no growth: fine
    with pytest.raises(RuntimeError, match="captured"):
        DequantWorkspace.shared(torch.device("cpu"), torch.float16, 128 * 65)
    del small, large
    assert DequantWorkspace.shared(torch.device("cpu"), torch.float16, 8).buffer.numel() == 8   # a new one


@pytest.mark.gpu
def test_gpu_dequant_at_the_8b_shapes_and_the_measured_table(tmp_path, monkeypatch):
    """The compiled pass at the Llama-3-8B shapes (qkv, down) equals the reference bit for bit, and
    the dispatch measures a table on this GPU (which path wins is BENCHMARKS.md's, not asserted)."""
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    for K, N in ((4096, 6144), (14336, 4096)):
        qw, s, z = (t.cuda() for t in tables(K, N, 128, torch.bfloat16, seed=K))
        assert torch.equal(int4_dequantize(qw, s, z, 128), dequantize_int4(qw, s, z, 128).to(torch.bfloat16))
    paths = dispatch_table(qw, s, z, 128)
    assert set(paths) == set(int4_dispatch.BUCKETS) and set(paths.values()) <= {"int4", "dequant"}
    x = torch.randn(512, 14336, device="cuda").to(torch.bfloat16)
    torch.testing.assert_close(int4_dispatch.dequant_matmul(x, qw, s, z, 128).float(),
                               int4_matmul_ref(x, qw, s, z, 128).float(), atol=0.1, rtol=2e-2)
