"""Programmatic dependent launch (ridge/kernels/pdl.py): when it is used, and on a GPU that a long
chain of dependent kernels gives bit-identical results with and without PDL, eagerly and
replayed from a CUDA graph (a kernel reading its input before the previous one finished would
show up as a mismatch)."""
import pytest
import torch

from ridge.kernels import pdl
from ridge.kernels.pdl import launch_options, use_pdl
from tests.tests_support import capture_cuda_graph

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_off_on_cpu():
    assert not use_pdl(torch.zeros(1))
    assert launch_options(False) == {}
    assert launch_options(True) == {"launch_pdl": True}


def _decode_chain(x, res, norm_w, w_up, w_down, layers):
    """A decode-shaped chain: fused residual RMSNorm -> GEMV (gate/up) -> GEMV with fused SiLU
    (down), `layers` times; every kernel reads what the one before it wrote."""
    from ridge.kernels.gemv import gemv
    from ridge.kernels.rmsnorm import rms_norm
    for _ in range(layers):
        h, res = rms_norm(x, norm_w, 1e-6, residual=res)
        x = gemv(gemv(h, w_up), w_down, act="silu_mul")
    return x, res


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_pdl_chain_is_bit_identical_eager_and_in_a_graph(rows, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    dev = torch.device("cuda")
    hidden, inter, layers = 1024, 2816, 24
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31, ()).item()))
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731
    x, res = rnd(rows, hidden), rnd(rows, hidden)
    norm_w, w_up, w_down = rnd(hidden), rnd(2 * inter, hidden) * 0.03, rnd(hidden, inter) * 0.03

    results = {}
    for on in (False, True):
        # the device check is the one place use_pdl can be turned off: without PDL as the reference
        monkeypatch.setattr(pdl, "_supports_pdl", lambda index: on)
        eager = _decode_chain(x, res, norm_w, w_up, w_down, layers)
        torch.cuda.synchronize()
        graph, static = capture_cuda_graph(lambda: _decode_chain(x, res, norm_w, w_up, w_down, layers))
        replays = []
        for _ in range(3):
            for t in static:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            replays.append(tuple(t.clone() for t in static))
        results[on] = (eager, replays)
    (e_off, r_off), (e_on, r_on) = results[False], results[True]
    assert all(torch.isfinite(t).all() for t in e_off)
    for a, b in zip(e_off, e_on):
        assert torch.equal(a, b)
    for rep in r_off + r_on:
        for a, b in zip(e_off, rep):
            assert torch.equal(a, b)
