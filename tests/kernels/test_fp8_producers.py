"""The FP8 producers: RMSNorm(+residual) and SiLU-and-mul with their output quantized for the FP8
GEMM in the same kernel (ridge/kernels/rmsnorm.py rms_norm_fp8, silu_mul.py silu_and_mul_fp8),
against their references (rms_norm_ref / silu_and_mul_ref, then quantize_act_fp8_ref), in the
Triton interpreter at ragged shapes, and at the 8B shapes on a GPU (marked `gpu`).

Tolerance, two checks:
  * The same arithmetic: the fused kernel's (e4m3, scales) equal quantize_act_fp8_ref of the unfused
    kernel's own output bit for bit (interpreter). On a GPU Triton's `/` is not correctly rounded,
    so, as for the standalone quantizer (tests/kernels/test_fp8_kernels.py), a code may sit one e4m3 step
    away where x / scale lies on a rounding boundary (under 1e-3 of the elements), and a scale
    within 1e-6.
  * Against the composed reference: the unfused kernels meet their references under the bf16
    contract of tests/kernels/test_fused_kernels.py (bit for bit except <= 2 ulps on <= 0.5% of the
    elements, where rsqrt / exp differ in the last fp32 bit). Such an element moves its code only
    where it lies on an e4m3 rounding boundary, and, where it is its group's largest, moves the
    group's scale by at most those 2 bf16 ulps (2^-7 relatively; fp32 activations: 1e-6), which
    can move other codes of the group by one step. So: every code within one e4m3 step of the
    reference's, at most 1% of them off, scales within 2^-7 (fp32: 1e-6).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

from ridge.kernels.fp8_gemm import FP8, quantize_act_fp8_ref  # noqa: E402
from ridge.kernels.rmsnorm import rms_norm, rms_norm_fp8, rms_norm_fp8_ref  # noqa: E402
from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU-tensor kernel tests run under TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in e4m3 steps (sign-magnitude codes made monotonic; -0 == +0)."""
    assert a.dtype == b.dtype == FP8

    def key(t):
        v = t.view(torch.uint8).to(torch.int32)
        return torch.where(v >= 0x80, 0x80 - v, v)
    return (key(a) - key(b)).abs()


def assert_same_quantization(got, want, what, max_steps=0, max_off=0.0, scale_rtol=0.0):
    """(e4m3, scales) pairs: codes within max_steps e4m3 steps, at most max_off of them off, scales
    within scale_rtol; shapes, dtypes and the scales' M-major layout equal."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == FP8 and q.shape == rq.shape and s.dtype == torch.float32 and s.shape == rs.shape, what
    assert s.stride(0) == 1 or s.shape[0] == 1, f"{what}: scales must be M-major, strides {s.stride()}"
    assert not torch.isnan(s).any(), f"{what}: a scale left unwritten"
    d = e4m3_steps(q, rq)
    assert d.max().item() <= max_steps, f"{what}: a code {d.max().item()} e4m3 steps off"
    assert (d > 0).float().mean().item() <= max_off, f"{what}: {(d > 0).float().mean().item():.3%} of codes off"
    torch.testing.assert_close(s, rs, rtol=scale_rtol, atol=0, msg=what)


def near_reference(dtype):
    """The composed-reference tolerance of the module docstring."""
    return dict(max_steps=1, max_off=0.01, scale_rtol=2.0**-7 if dtype == BF16 else 1e-6)


def norm_inputs(tokens, hidden, dtype, seed, device="cpu", strided=False):
    """x (a strided view when asked: rows wider than hidden), a residual, weight; an all-zero token."""
    g = torch.Generator(device=device).manual_seed(seed)
    wide = hidden + 7 if strided else hidden
    x = (torch.randn(tokens, wide, generator=g, device=device) * 3).to(dtype)[:, :hidden]
    x[tokens // 2] = 0
    res = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    res[tokens // 2] = 0
    w = (1 + 0.3 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    return x, res, w


def gate_up(tokens, inter, dtype, seed, device="cpu", strided=False):
    """[T, 2I] with gate values far into silu's tails (and a tiny negative product: codes of -0)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(tokens, 2 * inter + (5 if strided else 0), generator=g, device=device) * 4).to(dtype)
    x[0, 0], x[0, inter] = -20.0, 1.0          # silu(-20) * 1 = -4e-8: quantizes to -0
    return x[:, :2 * inter]


# ---------------------------------------------------------------------------------------- RMSNorm
@interpreted
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", [64, 200, 256])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_rms_norm_fp8_matches_the_references(tokens, hidden, dtype):
    """Hidden sizes below one group, ragged (a 72-channel tail group) and whole groups; x a strided
    view; with and without the residual, which is written as rms_norm writes it."""
    x, res, w = norm_inputs(tokens, hidden, dtype, seed=tokens * hidden, strided=True)
    (got, res_out), (want, want_res) = rms_norm_fp8(x, w, 1e-5, res), rms_norm_fp8_ref(x, w, 1e-5, res)
    assert torch.equal(res_out, want_res)
    assert_same_quantization(got, quantize_act_fp8_ref(rms_norm(x, w, 1e-5, res)[0]), "norm+residual, same arithmetic")
    assert_same_quantization(got, want, "norm+residual vs reference", **near_reference(dtype))
    got = rms_norm_fp8(x, w, 1e-5)
    assert_same_quantization(got, quantize_act_fp8_ref(rms_norm(x, w, 1e-5)), "norm, same arithmetic")
    assert_same_quantization(got, rms_norm_fp8_ref(x, w, 1e-5), "norm vs reference", **near_reference(dtype))


@interpreted
def test_rms_norm_fp8_in_place_residual_and_bad_input():
    x, res, w = norm_inputs(5, 160, BF16, seed=1)
    want_q, want_res = rms_norm_fp8_ref(x, w, 1e-6, res)
    kept = res
    got, res_out = rms_norm_fp8(x, w, 1e-6, res, residual_out=res)
    assert res_out is kept and torch.equal(res, want_res)
    assert_same_quantization(got, want_q, "in place", **near_reference(BF16))
    with pytest.raises(ValueError, match=r"rms_norm_fp8: x must be \[T, N\]"):
        rms_norm_fp8(x.view(5, 2, 80), w[:80], 1e-6)
    with pytest.raises(ValueError, match="with weight's dtype"):
        rms_norm_fp8(x, w.float(), 1e-6)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm_fp8(x, w, 1e-6, res[:3])


# ---------------------------------------------------------------------------------- SiLU-and-mul
@interpreted
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("inter", [64, 200, 384])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_silu_and_mul_fp8_matches_the_references(tokens, inter, dtype):
    """Widths below one group, ragged and whole groups (several programs a token at T = 1); the
    input a strided view. (A program is one token's BLOCK: below 128 tokens every width here gets
    the same BLOCK, so more tokens would only add programs.)"""
    x = gate_up(tokens, inter, dtype, seed=tokens + inter, strided=True)
    got = silu_and_mul_fp8(x)
    assert_same_quantization(got, quantize_act_fp8_ref(silu_and_mul(x)), "silu_mul, same arithmetic")
    assert_same_quantization(got, silu_and_mul_fp8_ref(x), "silu_mul vs reference", **near_reference(dtype))


@interpreted
def test_silu_and_mul_fp8_bad_input():
    with pytest.raises(ValueError, match=r"silu_and_mul_fp8: x must be \[T, 2I\]"):
        silu_and_mul_fp8(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="last dim must be even"):
        silu_and_mul_fp8(torch.randn(2, 7))


def test_empty_batches():
    """No tokens: empty results in the layout, no launch (runs without a GPU or the interpreter)."""
    q, s = rms_norm_fp8(torch.empty(0, 200), torch.ones(200), 1e-6)
    assert q.shape == (0, 200) and q.dtype == FP8 and s.shape == (0, 2)
    q, s = silu_and_mul_fp8(torch.empty(0, 400))
    assert q.shape == (0, 200) and s.shape == (0, 2)


def test_benchmark_plan_and_bytes(capsys, monkeypatch):
    """benchmarks/kernels/fp8_producers.py: the 8B shape at the four token counts; the separate pass moves
    the bf16 intermediate twice more (written, read back) than the fused kernel."""
    from tests.tests_support import load_benchmark
    b = load_benchmark("fp8_producers")
    monkeypatch.delenv("OUT", raising=False)
    plan = b.cases(b.parse_args([]))
    assert [(c["case"], c["T"]) for c in plan] == [(c, t) for c in ("norm", "silu") for t in (1, 64, 512, 4096)]
    assert b.fp8_bytes(3, 200) == 600 + 3 * 2 * 4
    for c in plan:
        k = b.HIDDEN if c["case"] == "norm" else b.INTER
        assert c["separate"] - c["fused"] == 2 * 2 * c["T"] * k
    assert b.case_bytes("silu", 2)["fused"] == 2 * 2 * b.INTER * 2 + b.fp8_bytes(2, b.INTER)
    b.main(["--dry-run", "--only", "silu", "--tokens", "64"])
    assert capsys.readouterr().out.startswith("1 cases")


# -------------------------------------------------------------------------------------------- GPU
HIDDEN, INTER = 4096, 14336
ON_GPU = dict(max_steps=1, max_off=1e-3, scale_rtol=1e-6)      # the same arithmetic, Triton's `/`


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", [1, 64, 512, 4096])
def test_gpu_fused_producers_at_8b_shapes(tokens):
    seed = int.from_bytes(os.urandom(4), "little")
    x, res, w = norm_inputs(tokens, HIDDEN, BF16, seed, device="cuda")
    (got, res_out), (want, want_res) = rms_norm_fp8(x, w, 1e-5, res), rms_norm_fp8_ref(x, w, 1e-5, res)
    assert torch.equal(res_out, want_res), seed
    assert_same_quantization(got, quantize_act_fp8_ref(rms_norm(x, w, 1e-5, res)[0]), f"norm seed {seed}", **ON_GPU)
    assert_same_quantization(got, want, f"norm vs reference seed {seed}", **near_reference(BF16))
    got = rms_norm_fp8(x, w, 1e-5)
    assert_same_quantization(got, rms_norm_fp8_ref(x, w, 1e-5), f"norm no residual seed {seed}", **near_reference(BF16))
    gu = gate_up(tokens, INTER, BF16, seed, device="cuda")
    got = silu_and_mul_fp8(gu)
    assert_same_quantization(got, quantize_act_fp8_ref(silu_and_mul(gu)), f"silu_mul seed {seed}", **ON_GPU)
    assert_same_quantization(got, silu_and_mul_fp8_ref(gu), f"silu_mul vs reference seed {seed}",
                             **near_reference(BF16))


@pytest.mark.gpu
@needs_gpu
def test_gpu_fused_producers_replay_in_a_cuda_graph():
    """The decode step captures them: replayed on new inputs, the graph's outputs are the eager ones."""
    from tests.tests_support import capture_cuda_graph
    x, res, w = norm_inputs(8, HIDDEN, BF16, seed=5, device="cuda")
    gu = gate_up(8, INTER, BF16, seed=6, device="cuda")
    graph, (norm_out, silu_out) = capture_cuda_graph(lambda: (rms_norm_fp8(x, w, 1e-5, res), silu_and_mul_fp8(gu)))
    x.copy_(norm_inputs(8, HIDDEN, BF16, seed=7, device="cuda")[0])
    gu.copy_(gate_up(8, INTER, BF16, seed=8, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for (q, s), (eq, es) in ((norm_out[0], rms_norm_fp8(x, w, 1e-5, res)[0]), (silu_out, silu_and_mul_fp8(gu))):
        assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8)) and torch.equal(s, es)
