"""Fused Triton kernels (RMSNorm + residual, SiLU-and-mul, rotary) vs their torch references.

On CPU the kernels run under the Triton interpreter (chosen before triton is imported); with a
GPU they compile and the CPU-tensor tests are skipped; the `gpu` tests at Llama-8B shapes are in
tests/kernels/test_fused_kernels_gpu.py.

Rounding contract (bf16): RMSNorm and SiLU-and-mul round at exactly the reference's points, so
they agree bit for bit except where rsqrt/exp or the reduction order differ in the last fp32 bit
and that flips the rounding of the intermediate (normed, silu(gate)) by 1 bf16 ulp - measured
~3e-5 of the elements. The following multiply by weight/up can carry that 1 ulp into a lower
binade, where it is 2 ulps of the output, so the check is: <= 2 ulps, on <= 0.5% of elements.
(Dropping the intermediate rounding, a real bug, mismatches ~26% of elements; truncating
instead of rounding ~74%.) Rotary computes in fp32 and rounds once where the reference rounds
cos/sin and each op: it is checked against the correctly rounded fp32 result (bit for bit in
the interpreter; on the GPU, where Triton fuses the products into FMAs, within one rounding plus
a few fp32 ulps of |x|), and against the reference within the reference's own error bound.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

from ridge.kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from ridge.kernels.rotary import apply_rotary_ref, rope_write_kv  # noqa: E402
from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402
from ridge.layers import activation, norm  # noqa: E402
from ridge.layers.activation import SiluAndMul  # noqa: E402
from ridge.layers.norm import RMSNorm  # noqa: E402
from ridge.layers.rotary import RotaryEmbedding  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
NEAR = (2, 0.005)          # (max ulps, max fraction of elements differing): see the contract above
ONE_ROUNDING = (1, 0.005)  # rotary vs the correctly rounded fp32 result, FMA contraction allowed
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _cpu_tests_need_the_interpreter(request):
    if "gpu" not in request.keywords and not INTERPRET:
        pytest.skip("CPU-tensor kernel tests run under TRITON_INTERPRET=1")


def apply_rotary(positions, q, k, cos, sin, q_out=None, k_out=None):
    """The rotation alone: the engine's rope_write_kv with every slot negative (nothing cached)."""
    cache = torch.empty(1, 1, *k.shape[1:], dtype=k.dtype, device=k.device)
    slots = torch.full((k.shape[0],), -1, dtype=torch.int64, device=k.device)
    return rope_write_kv(positions, q, k, k, cos, sin, cache, cache, slots, q_out=q_out, k_out=k_out)[:2]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (bf16/fp16: 16-bit patterns, sign-aware)."""
    assert a.dtype == b.dtype and a.element_size() == 2

    def key(t):
        v = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        return torch.where(v >= 0x8000, 0x8000 - v, v)   # monotonic in the value, -0 == +0
    return (key(a) - key(b)).abs()


def assert_bf16_match(out, ref, max_ulps, max_mismatch_frac, what=""):
    """Bitwise equal except <= max_ulps on at most max_mismatch_frac of the elements."""
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element left unwritten?)"
    d = ulps(out, ref)
    frac = (d > 0).float().mean().item()
    assert d.max().item() <= max_ulps, f"{what}: max {d.max().item()} ulp"
    assert frac <= max_mismatch_frac, f"{what}: {frac:.3%} of elements differ"


def poisoned(*shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("hidden", [96, 160])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rms_norm_residual(tokens, hidden, dtype):
    g = gen(tokens * hidden)
    # views into wider buffers: row strides are not the hidden size (the kernel gets the strides)
    x = (torch.randn(tokens, hidden + 5, generator=g) * 3).to(dtype)[:, 2:2 + hidden]
    res = torch.randn(tokens, 2 * hidden, generator=g).to(dtype)[:, :hidden]
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    out, res_out = poisoned(tokens, hidden, dtype=dtype), poisoned(tokens, hidden, dtype=dtype)
    got = rms_norm(x, w, 1e-5, res, out=out, residual_out=res_out)
    assert got[0] is out and got[1] is res_out
    ref_res = x + res
    ref = rms_norm_ref(ref_res, w, 1e-5)
    assert torch.equal(res_out, ref_res)            # one add, one rounding: exact in any dtype
    if dtype == FP32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:
        assert_bf16_match(out, ref, *NEAR, "rmsnorm bf16")
    # no residual: only the norm
    out2 = rms_norm(x, w, 1e-5, out=poisoned(tokens, hidden, dtype=dtype))
    if dtype == FP32:
        torch.testing.assert_close(out2, rms_norm_ref(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    else:
        assert_bf16_match(out2, rms_norm_ref(x, w, 1e-5), *NEAR, "rmsnorm bf16 no residual")


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_rms_norm_per_head_qk_views(dtype):
    """Qwen3's q/k norm: [T, H, d] views split out of the fused QKV output, normalised over d."""
    T, H, KVH, D = 7, 4, 2, 128
    g = gen(3)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    before = qkv.clone()
    for t, n in ((q, H), (k, KVH)):
        w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
        out = rms_norm(t, w, 1e-6, out=poisoned(T, n, D, dtype=dtype))
        ref = rms_norm_ref(t, w, 1e-6)
        if dtype == FP32:
            torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        else:
            assert_bf16_match(out, ref, *NEAR, "per-head norm")
    assert torch.equal(qkv, before)   # the inputs are read, never written


def test_rms_norm_in_place_strided_last_dim_and_promotion():
    g = gen(5)
    T, N = 33, 160
    x = torch.randn(T, N, generator=g)
    res = torch.randn(T, N, generator=g)
    w = torch.randn(N, generator=g)
    ref_res = x + res
    ref = rms_norm_ref(ref_res, w, 1e-5)
    out, res_back = rms_norm(x, w, 1e-5, res, residual_out=res)   # residual updated in place
    assert res_back is res and torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    # last-dim stride 2 (every other column) and a 1-D input
    wide = torch.randn(T, 2 * N, generator=g)
    torch.testing.assert_close(rms_norm(wide[:, ::2], w, 1e-5), rms_norm_ref(wide[:, ::2], w, 1e-5),
                               rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(rms_norm(x[3], w, 1e-5), rms_norm_ref(x[3], w, 1e-5), rtol=2e-6, atol=2e-6)
    # bf16 activations with an fp32 weight promote to fp32, exactly as `weight * x.to(bf16)` does
    xb = x.to(BF16)
    out = rms_norm(xb, w, 1e-5)
    assert out.dtype == FP32
    torch.testing.assert_close(out, rms_norm_ref(xb, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_rms_norm_long_rows():
    """Rows longer than 2048 (one row per program, a masked 8192-wide tile for 4100)."""
    g = gen(9)
    x, res = torch.randn(3, 4100, generator=g).to(BF16), torch.randn(3, 4100, generator=g).to(BF16)
    w = (1 + 0.3 * torch.randn(4100, generator=g)).to(BF16)
    out, res_out = rms_norm(x, w, 1e-5, res)
    assert torch.equal(res_out, x + res)
    assert_bf16_match(out, rms_norm_ref(x + res, w, 1e-5), *NEAR, "rmsnorm hidden 4100")


def test_rms_norm_rejects_bad_shapes():
    x = torch.randn(4, 96)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(95), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(96), 1e-5, residual=torch.randn(4, 96, dtype=BF16))
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, torch.ones(96), 1e-5, out=torch.empty(4, 95))


# ---------------------------------------------------------------------------------- SiLU-and-mul
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("inter", [96, 160])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_silu_and_mul(tokens, inter, dtype):
    g = gen(tokens + inter)
    buf = (torch.randn(tokens, 2 * inter + 8, generator=g) * 4).to(dtype)
    buf[0, :4] = torch.tensor([-100.0, 100.0, -1e4, 0.0]).to(dtype)   # exp overflow -> -0, no NaN
    x = buf[:, 3:3 + 2 * inter]                                       # strided rows
    out = silu_and_mul(x, out=poisoned(tokens, inter, dtype=dtype))
    ref = silu_and_mul_ref(x)
    assert not torch.isnan(out).any()
    if dtype == FP32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    else:
        assert_bf16_match(out, ref, *NEAR, "silu_and_mul bf16")


def test_silu_and_mul_shapes():
    g = gen(11)
    x = torch.randn(2, 3, 2 * 96, generator=g)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(silu_and_mul(x[0, 0]), silu_and_mul_ref(x[0, 0]), rtol=2e-6, atol=1e-6)
    wide = torch.randn(5, 4 * 96, generator=g)   # last-dim stride 2
    torch.testing.assert_close(silu_and_mul(wide[:, ::2]), silu_and_mul_ref(wide[:, ::2]),
                               rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(3, 7))


# ---------------------------------------------------------------------------------------- rotary
def rope_truth(positions, x, rope):
    """fp32 rotate-half from the fp32 tables, no intermediate rounding (then rounded once)."""
    cos, sin = rope.cos[positions][:, None, :], rope.sin[positions][:, None, :]
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return xf * cos + rot * sin


def assert_rotary_bf16(out, x, truth, ref=None):
    """bf16 unit roundoff u = 2^-8. The kernel rounds the fp32 result once: |out - truth| <=
    u |truth|, plus a few fp32 ulps of the inputs' size where the GPU fuses a product into an FMA
    (which matters only where x1*cos and x2*sin nearly cancel). The reference rounds cos/sin,
    both products and the sum: |ref - truth| <= 2u (|x1| + |x2|) + u |truth|, so kernel and
    reference differ by at most 2u (|x1| + |x2| + |truth|), and the kernel's error is smaller.
    Where the two products do not nearly cancel (|truth| >= 2^-10 (|x1| + |x2|)), the FMA's
    fp32 difference is far below a bf16 ulp of the result: there out is the correctly rounded
    value or (rarely) 1 ulp from it."""
    half = x.shape[-1] // 2
    mag = (x.float()[..., :half].abs() + x.float()[..., half:].abs()).repeat(1, 1, 2)
    err = (out.float() - truth).abs()
    assert (err <= 2.0**-8 * truth.abs() + 2.0**-21 * mag).all(), "rotary: more than one rounding from fp32"
    well = truth.abs() >= 2.0**-10 * mag
    assert_bf16_match(out[well], truth.to(out.dtype)[well], *ONE_ROUNDING, "rotary vs rounded fp32")
    if ref is not None:
        assert ((out.float() - ref.float()).abs() <= 2.0**-7 * (mag + truth.abs())).all()
        assert err.norm() < (ref.float() - truth).norm()


def qkv_views(T, H, KVH, D, dtype, g):
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2).to(dtype)
    return qkv, qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rotary(tokens, head_dim, dtype):
    H, KVH, MAX_POS = 4, 2, 4096
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024} if head_dim == 64 else None
    rope = RotaryEmbedding(head_dim, MAX_POS, 10000.0, scaling)
    half = head_dim // 2
    assert torch.equal(rope.cos[:, :half], rope.cos[:, half:])   # the kernel reads one half
    g = gen(tokens * head_dim)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g)
    positions[0] = MAX_POS - 1
    qkv, q, k = qkv_views(tokens, H, KVH, head_dim, dtype, g)
    before = qkv.clone()
    q_out, k_out = poisoned(tokens, H, head_dim, dtype=dtype), poisoned(tokens, KVH, head_dim, dtype=dtype)
    got = apply_rotary(positions, q, k, rope.cos, rope.sin, q_out=q_out, k_out=k_out)
    assert got[0] is q_out and got[1] is k_out
    assert torch.equal(qkv, before)
    ref_q, ref_k = apply_rotary_ref(positions, q, k, rope.cos, rope.sin)
    for out, ref, x in ((q_out, ref_q, q), (k_out, ref_k, k)):
        if dtype == FP32:
            # the same fp32 products and sum in the same order as the reference: identical
            assert torch.equal(out, ref)
        else:
            truth = rope_truth(positions, x, rope)
            # one rounding of the fp32 result: bitwise the correctly rounded value
            assert_bf16_match(out, truth.to(dtype), 0, 0.0, "rotary vs rounded fp32")
            assert_rotary_bf16(out, x, truth, ref)


def test_rotary_more_heads_than_one_tile():
    """40 q heads of 128: tiles of 32 heads, two unrolled steps, the second one masked."""
    rope = RotaryEmbedding(128, 64, 10000.0, None)
    g = gen(17)
    positions = torch.randint(0, 64, (3,), generator=g)
    _, q, k = qkv_views(3, 40, 8, 128, BF16, g)
    q_out, k_out = apply_rotary(positions, q, k, rope.cos, rope.sin)
    ref_q, ref_k = apply_rotary_ref(positions, q, k, rope.cos, rope.sin)
    for out, x, ref in ((q_out, q, ref_q), (k_out, k, ref_k)):
        truth = rope_truth(positions, x, rope)
        assert_bf16_match(out, truth.to(BF16), 0, 0.0, "rotary 40 heads")
        assert_rotary_bf16(out, x, truth, ref)


def test_rotary_in_place_and_contiguous_inputs():
    rope = RotaryEmbedding(64, 128, 500000.0, None)
    g = gen(21)
    T = 9
    positions = torch.randint(0, 128, (T,), generator=g)
    q, k = torch.randn(T, 8, 64, generator=g), torch.randn(T, 1, 64, generator=g)   # MQA
    ref_q, ref_k = apply_rotary_ref(positions, q, k, rope.cos, rope.sin)
    q_back, k_back = apply_rotary(positions, q, k, rope.cos, rope.sin, q_out=q, k_out=k)
    assert q_back is q and k_back is k
    torch.testing.assert_close(q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, ref_k, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(positions[:3], q, k, rope.cos, rope.sin)


def test_layers_use_the_reference_on_cpu(monkeypatch):
    """On CPU tensors the layers never reach a Triton launcher (the parity tests rely on it).
    (Rotary is applied by the attention backend: tests/kernels/test_rope_kv_write.py.)"""
    def boom(*a, **kw):
        raise AssertionError("Triton path taken for a CPU tensor")
    monkeypatch.setattr(norm, "rms_norm", boom)
    monkeypatch.setattr(activation, "silu_and_mul", boom)
    layer = RMSNorm(32, 1e-6)
    layer.weight.data.fill_(1.0)
    x = torch.randn(3, 32)
    layer(x), layer(x, x)
    SiluAndMul()(torch.randn(3, 8))
