"""The FP8 kernels (ridge/kernels/fp8_gemm.py, issue 16) against their torch references: per-token,
per-128-channel activation quantization bit for bit, and the block-scaled GEMM within fp32
summation order at ragged M, N and K, in the Triton interpreter on the CPU (and at 8B shapes on a
GPU, marked `gpu`)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

from ridge.kernels.fp8_gemm import (FP8, FP8_MAX, cublas_fp8_gemm, fp8_gemm, fp8_gemm_ref,  # noqa: E402
                                    quantize_act_fp8, quantize_act_fp8_ref)
from ridge.layers.quant.fp8.formats import quantize_fp8_block  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU-tensor kernel tests run under TRITON_INTERPRET=1")
SMALL = dict(block_m=16, block_n=32, num_warps=4, num_stages=1)     # the interpreter runs every program


def activations(m, k, dtype, seed, device="cpu"):
    """Tokens of very different magnitudes, one all-zero token, never all zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) * torch.logspace(-2, 2, m, device=device)[:, None]
    x[m // 2] = 0
    return x.to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,k", [(1, 128), (7, 200), (3, 5), (4, 328), (45, 200)])
def test_activation_quantization_is_the_reference_bit_for_bit(m, k, dtype):
    x = activations(m, k, dtype, seed=m * k)
    q, s = quantize_act_fp8(x)
    rq, rs = quantize_act_fp8_ref(x)
    assert q.dtype == FP8 and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    per = s.repeat_interleave(128, dim=1)[:, :k]
    deq = q.float() * per
    assert ((deq - x.float()).abs() <= 2.0**-4 * x.float().abs() + 2.0**-10 * per).all()
    assert q.float().abs().max() <= FP8_MAX


VARIANTS = {"tiles": {}, "split-k": dict(split_k=3), "tma": dict(tma=True, block_n=64)}


@interpreted
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m,n,k", [(5, 200, 336), (33, 72, 256), (1, 40, 128), (17, 128, 130)])
def test_block_scaled_gemm_matches_the_reference(m, n, k, variant):
    """The three kernel variants (tile per program, split K, persistent TMA) at ragged shapes; the
    TMA kernel only where rows are 16-byte aligned (K = 130 is refused, as tested below)."""
    if variant == "tma" and k % 16:
        pytest.skip("TMA needs K % 16 == 0")
    xq, xs = quantize_act_fp8(activations(m, k, torch.bfloat16, seed=m + n + k))
    g = torch.Generator().manual_seed(n)
    wq, ws = quantize_fp8_block((torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]))
    y = fp8_gemm(xq, xs, wq, ws, **{**SMALL, **VARIANTS[variant]})
    ref = fp8_gemm_ref(xq, xs, wq, ws, torch.float32)
    assert y.dtype == torch.bfloat16      # one bf16 rounding, plus fp32 summation order
    assert ((y.float() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()


@interpreted
def test_fp8_product_is_close_to_the_bf16_one():
    """End to end: both operands quantized, the product within e4m3's few-percent error of x @ W^T."""
    x = torch.randn(9, 384, dtype=torch.bfloat16)
    w = torch.randn(96, 384) * 0.05
    xq, xs = quantize_act_fp8(x)
    wq, ws = quantize_fp8_block(w)
    y = fp8_gemm(xq, xs, wq, ws, **SMALL).float()
    exact = x.float() @ w.t()
    assert (y - exact).norm() / exact.norm() < 0.05


def test_bad_arguments_are_named():
    xq, xs = quantize_act_fp8_ref(torch.randn(4, 256))
    wq, ws = quantize_fp8_block(torch.randn(64, 256))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match=r"x_scale must be float32 \[4, 2\]"):
        fp8_gemm(xq, xs[:, :1], wq, ws)
    with pytest.raises(ValueError, match=r"w_scale must be float32 \[1, 2\]"):
        fp8_gemm(xq, xs, wq, ws.double())
    with pytest.raises(ValueError, match="TMA kernel needs K % 16 == 0"):
        fp8_gemm(*quantize_act_fp8_ref(torch.randn(4, 130)), *quantize_fp8_block(torch.randn(64, 130)), tma=True)
    with pytest.raises(ValueError, match="2-D float tensor"):
        quantize_act_fp8(torch.zeros(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 64, 300, 2048])
def test_gpu_8b_shapes(m):
    """On the GPU, `/` is not correctly rounded in Triton, so the quantized activations may differ
    from the reference by one e4m3 step on a few elements; the GEMM is checked on shared inputs."""
    seed = int.from_bytes(os.urandom(4), "little")
    for n, k in ((6144, 4096), (4096, 14336), (28672, 4096)):
        x = activations(m, k, torch.bfloat16, seed, device="cuda")
        q, s = quantize_act_fp8(x)
        rq, rs = quantize_act_fp8_ref(x)
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
        assert (q.float() != rq.float()).float().mean() < 1e-3, seed
        wq, ws = quantize_fp8_block(torch.randn(n, k, device="cuda") * 0.02)
        ref = fp8_gemm_ref(q, s, wq, ws, torch.float32)
        # Hopper's FP8 MMA adds its products with ~14 mantissa bits inside each promoted K block
        # (DeepSeek-V3's report): allow 2^-12 of the sum of |products|, beside one bf16 rounding
        products = fp8_gemm_ref(q.float().abs(), s, wq.float().abs(), ws, torch.float32)
        for cfg in ({}, dict(tma=True), dict(block_m=64, split_k=4)):
            y = fp8_gemm(q, s, wq, ws, **cfg).float()
            assert ((y - ref).abs() <= 2.0**-8 * ref.abs() + 2.0**-12 * products).all(), (seed, cfg)
            if m >= 64:   # and the cuBLAS path the engine may dispatch to computes the same product
                yc = cublas_fp8_gemm(q, s, wq, ws).float()
                assert ((yc - ref).abs() <= 2.0**-8 * ref.abs() + 2.0**-12 * products).all(), (seed, "cublas")


@interpreted
def test_e4m3_rounding_at_binade_edges_ties_and_subnormals():
    """Values that round up into the next binade, exact ties (to even), subnormals (step 2^-9), a
    negative value that rounds to -0, and the largest finite value: the kernel's e4m3 equals torch's, where Triton's interpreter alone
    would turn 124.3 into 64."""
    row = torch.tensor([448.0, 124.3, -125.9, 239.9, 15.9, 0.0146, 2.0**-10, 3 * 2.0**-10, 0.0155,
                        9.0 * 2.0**-3 * 0.5 + 1.0, 13.0, -11.0, 2.0**-7 + 2.0**-10, -2.0**-12] + [0.5] * 114)
    q, s = quantize_act_fp8(row[None])
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), row[None].to(FP8).view(torch.uint8))


def test_benchmark_plan_and_dry_run(capsys, monkeypatch):
    from tests.tests_support import load_benchmark
    b = load_benchmark("fp8_gemm")
    monkeypatch.delenv("OUT", raising=False)
    plan = b.cases(b.parse_args([]))
    assert len(plan) == (4 + 3) * 5 and {c["M"] for c in plan} == {64, 128, 512, 2048, 4096}
    assert ("7168x16384", 7168, 16384) in {(c["proj"], c["N"], c["K"]) for c in plan}
    assert b.fp8_bytes(dict(M=1, N=128, K=256)) == 256 + 128 * 256 + 4 * (2 + 2) + 2 * 128
    b.main(["--dry-run", "--models", "deepseek-v3", "--rows", "64"])
    assert capsys.readouterr().out.startswith("3 cases")
    rows = [dict(M=4096, x_cublas_block=0.95), dict(M=128, x_cublas_block=1.2), dict(M=512, x_cublas_block=None)]
    v = b.verdicts(rows)
    assert v["x_cublas_block_at_M_ge_2048"]["met"] and not v["x_cublas_block_at_M_le_128"]["met"]
