"""The fused RoPE + KV write into an FP8 cache (ridge/kernels/kv_fp8.py's format), with and without
the Hadamard rotation of q and k: against the kernel's own rotation followed by the torch
quantization (bit for bit), and against the torch reference backend (rope_write_kv_ref)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
from tests.kernels.test_fused_kernels import apply_rotary  # noqa: E402
from tests.kernels.test_rope_kv_write import PAGE, make_inputs  # noqa: E402

from ridge.kernels.kv_fp8 import FP8, dequantize_rows_ref, hadamard_signs, quantize_rows_ref, scale_of  # noqa: E402
from ridge.kernels.rotary import rope_write_kv, rope_write_kv_ref, rotate_ref  # noqa: E402
from ridge.layers.rotary import RotaryEmbedding  # noqa: E402

interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU-tensor kernel tests run under TRITON_INTERPRET=1")


def fp8_caches(num_pages, kvh, d, device="cpu"):
    """FP8 caches poisoned with NaN (0x7F) and scale bytes poisoned with 0xFF."""
    caches = [torch.full((num_pages, PAGE, kvh, d), 0x7F, dtype=torch.uint8, device=device).view(FP8)
              for _ in range(2)]
    scales = [torch.full((num_pages, PAGE, kvh), 0xFF, dtype=torch.uint8, device=device) for _ in range(2)]
    return caches, scales


def run_case(tokens, heads, kvh, d, dtype, rotate, seed, device="cpu"):
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    rope.cos, rope.sin = rope.cos.to(device), rope.sin.to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    _, q, k, v, positions, slots, _ = make_inputs(tokens, heads, kvh, d, dtype, g, num_pages=-(-tokens // PAGE) + 2,
                                                  max_pos=512, device=device, pad_rows=(1,) if tokens > 2 else ())
    k[:, :, 3] *= 40                                             # an outlier channel
    (kc, vc), scales = fp8_caches(-(-tokens // PAGE) + 2, kvh, d, device)
    signs = hadamard_signs(d, seed=seed).to(device) if rotate else None
    q1, k1, v1 = rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots, kv_scales=scales,
                               rotation=signs)
    return rope, q, k, v, positions, slots, (kc, vc), scales, signs, (q1, k1, v1)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens,heads,kvh,d", [(5, 4, 2, 64), (19, 8, 1, 128)])
def test_fp8_write_is_the_rotation_then_the_torch_quantization(tokens, heads, kvh, d, dtype):
    rope, q, k, v, positions, slots, (kc, vc), (ks, vs), _, (q1, k1, v1) = run_case(tokens, heads, kvh, d, dtype,
                                                                                    False, seed=tokens)
    q2, k2 = apply_rotary(positions, q, k, rope.cos, rope.sin)
    assert torch.equal(q1, q2)
    real = slots >= 0
    for x, cache, scale, out in ((k2, kc, ks, k1), (v, vc, vs, v1)):
        want_q, want_s = quantize_rows_ref(x)
        flat, flat_s = cache.view(-1, kvh, d), scale.view(-1, kvh)
        assert torch.equal(flat[slots[real]].view(torch.uint8), want_q[real].view(torch.uint8))
        assert torch.equal(flat_s[slots[real]], want_s[real])
        assert torch.equal(out, dequantize_rows_ref(want_q, want_s, dtype))   # what attention reads
    untouched = torch.ones(kc.shape[0] * PAGE, dtype=torch.bool)
    untouched[slots[real]] = False
    assert (kc.view(-1, kvh, d)[untouched].view(torch.uint8) == 0x7F).all()
    assert (vs.view(-1, kvh)[untouched] == 0xFF).all()
    # every stored row fits e4m3 without clamping: its maximum lands in [128, 256] (256: rounded up)
    amax = kc.view(-1, kvh, d)[slots[real]].float().abs().amax(-1)
    assert ((amax >= 128) | (amax == 0)).all() and (amax <= 256).all()
    assert (scale_of(ks.view(-1, kvh)[slots[real]]) > 0).all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_hadamard_rotation_matches_the_reference_and_keeps_scores(dtype):
    tokens, heads, kvh, d = 9, 4, 2, 64
    rope, q, k, v, positions, slots, (kc, vc), (ks, vs), signs, (q1, k1, v1) = run_case(tokens, heads, kvh, d, dtype,
                                                                                         True, seed=3)
    real = slots >= 0
    q0, k0 = apply_rotary(positions, q, k, rope.cos, rope.sin)       # the kernel's RoPE alone
    one_ulp = dict(rtol=2 ** -7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q1, rotate_ref(q0, signs), **one_ulp)    # fp32 summation order, one rounding
    # the cache holds what k1 says, and that is the rotated k to e4m3 precision (per row's scale)
    flat, flat_s = kc.view(-1, kvh, d)[slots[real]], ks.view(-1, kvh)[slots[real]]
    assert torch.equal(dequantize_rows_ref(flat, flat_s, dtype), k1[real])
    rk = rotate_ref(k0, signs).float()[real]
    assert ((k1[real].float() - rk).abs() <= 2 ** -4 * rk.abs() + scale_of(flat_s)[..., None] * 2 ** -3).all()
    assert torch.equal(v1, dequantize_rows_ref(*quantize_rows_ref(v), dtype))     # v is not rotated
    # the torch backend (its own RoPE rounding, then the same rotation and quantization) agrees
    (rkc, rvc), (rks, rvs) = fp8_caches(kc.shape[0], kvh, d)
    q3, k3, v3 = rope_write_kv_ref(positions[real], q[real], k[real], v[real], rope.cos, rope.sin, rkc, rvc,
                                   slots[real], kv_scales=(rks, rvs), rotation=signs)
    torch.testing.assert_close(q1[real], q3, rtol=2 ** -5, atol=2 ** -5)
    torch.testing.assert_close(k1[real].float(), k3.float(), rtol=2 ** -3, atol=2 ** -5 * k3.float().abs().max().item())
    assert torch.equal(v1[real], v3)
    # the rotation is orthogonal: rotated scores are the plain ones
    plain = torch.einsum("thd,tkd->thk", q0.float(), k0.float())
    rotated = torch.einsum("thd,tkd->thk", rotate_ref(q0.float(), signs), rotate_ref(k0.float(), signs))
    torch.testing.assert_close(rotated, plain, rtol=1e-4, atol=1e-3)


def test_bad_scales_are_named():
    rope = RotaryEmbedding(64, 64, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    _, q, k, v, positions, slots, _ = make_inputs(3, 4, 2, 64, torch.float32, g, num_pages=1, max_pos=64)
    (kc, vc), (ks, vs) = fp8_caches(1, 2, 64)
    with pytest.raises(ValueError, match="needs kv_scales"):
        rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots)
    with pytest.raises(ValueError, match="k_scale must be uint8"):
        rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots, kv_scales=(ks.float(), vs))
    with pytest.raises(ValueError, match="rotation must be"):
        rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots, kv_scales=(ks, vs),
                      rotation=torch.ones(32, 32))   # head_dim is 64
    bf = torch.zeros(1, PAGE, 2, 64)
    with pytest.raises(ValueError, match="only an FP8 cache has scales"):
        rope_write_kv(positions, q, k, v, rope.cos, rope.sin, bf, bf, slots, kv_scales=(ks, vs))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_signs(96)


def test_hadamard_lowers_attention_error_on_outliers():
    """benchmarks/kernels/kv_fp8_error.py at a small size: the rotation lowers attention's error over an
    FP8 cache on FlashAttention-3's outlier inputs."""
    from tests.tests_support import load_benchmark
    e = load_benchmark("kv_fp8_error").errors(256, 64, 2, seed=0)
    assert e["rmse_fp8_hadamard"] < e["rmse_fp8"] < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dims", [(512, 6, 2, 64), (300, 32, 8, 128)], ids=["demo", "llama8b"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "hadamard"])
def test_gpu_fp8_write(dims, rotate):
    """The compiled kernel: the cache is the torch quantization of the kernel's own rotated k (and
    of v) up to e4m3 steps where fp32 summation order flips a rounding, and k_out, v_out are the
    dequantized cache."""
    tokens, heads, kvh, d = dims
    rope, q, k, v, positions, slots, (kc, vc), (ks, vs), signs, (q1, k1, v1) = run_case(
        tokens, heads, kvh, d, torch.bfloat16, rotate, seed=tokens, device="cuda")
    q0, k0 = apply_rotary(positions, q, k, rope.cos, rope.sin)
    if rotate:
        q0, k0 = rotate_ref(q0, signs), rotate_ref(k0, signs)
    torch.testing.assert_close(q1, q0, rtol=2 ** -7, atol=1e-5)
    real = slots >= 0
    for x, cache, scale, out in ((k0, kc, ks, k1), (v, vc, vs, v1)):
        flat, flat_s = cache.view(-1, kvh, d)[slots[real]], scale.view(-1, kvh)[slots[real]]
        deq = dequantize_rows_ref(flat, flat_s, torch.bfloat16)
        assert torch.equal(deq, out[real])
        ref = x[real].float()
        assert ((deq.float() - ref).abs() <= 2 ** -3 * ref.abs() + scale_of(flat_s)[..., None]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_demo_model_fp8_kv_logprobs_match_the_torch_backend():
    """The demo model over an FP8 cache: prompt log-probabilities (the prefill kernels) of the Triton
    kernels and the torch reference backend (same cache format) agree and stay near the bf16 cache's;
    greedy decoding (the decode kernel, in CUDA graphs) follows the reference's tokens."""
    from ridge import LLM, SamplingParams
    from ridge.eval_ppl import token_logprobs
    ids = [list(range(5, 300, 3)), list(range(40, 400, 7))]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    got, tokens = {}, {}
    for name, kw in (("bf16", dict()), ("torch", dict(kv_cache_dtype="fp8", attention_backend="torch")),
                     ("triton", dict(kv_cache_dtype="fp8"))):
        with LLM(dtype="bfloat16", enforce_eager=name != "triton", kv_cache_memory=2**28, **kw) as llm:
            outs = llm.generate(ids, params, use_tqdm=False)
            got[name] = torch.tensor([lp for o in outs for lp in token_logprobs(o)])
            outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    for a, b in zip(tokens["triton"], tokens["torch"]):   # a near-tie may flip late, never early
        assert a[:8] == b[:8], (a, b)
    assert (got["triton"] - got["torch"]).abs().mean() < 0.05, (got["triton"] - got["torch"]).abs().mean()
    assert (got["triton"] - got["bf16"]).abs().mean() < 0.2, (got["triton"] - got["bf16"]).abs().mean()
