"""Fused Triton kernels (RMSNorm + residual, SiLU-and-mul, rotary) at Llama-8B shapes on a GPU
(marked `gpu`): against their torch references under the rounding contract of
tests/kernels/test_fused_kernels.py, captured in CUDA graphs, and dispatched to by the layers."""
import os

import pytest
import torch

from ridge.kernels.rmsnorm import rms_norm, rms_norm_ref
from ridge.kernels.rotary import apply_rotary_ref
from ridge.kernels.silu_mul import silu_and_mul, silu_and_mul_ref
from ridge.layers import activation, norm
from ridge.layers.activation import SiluAndMul
from ridge.layers.norm import RMSNorm
from ridge.layers.rotary import RotaryEmbedding
from tests.kernels.test_fused_kernels import (BF16, NEAR, apply_rotary, assert_bf16_match, assert_rotary_bf16, needs_gpu,
                                poisoned, rope_truth)
from tests.tests_support import capture_cuda_graph


HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
GPU_TOKENS = [1, 64, 4096]


def fresh_generator():
    seed = int.from_bytes(os.urandom(4), "little")   # new inputs every run; printed on failure
    return torch.Generator(device="cuda").manual_seed(seed), seed


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
def test_gpu_rms_norm(tokens):
    g, seed = fresh_generator()
    dev = "cuda"
    x = torch.randn(tokens, HIDDEN, generator=g, device=dev).to(BF16)
    res = torch.randn(tokens, HIDDEN, generator=g, device=dev).to(BF16)
    w = (1 + 0.3 * torch.randn(HIDDEN, generator=g, device=dev)).to(BF16)
    out, res_out = poisoned(tokens, HIDDEN, dtype=BF16, device=dev), poisoned(tokens, HIDDEN, dtype=BF16, device=dev)
    rms_norm(x, w, 1e-5, res, out=out, residual_out=res_out)
    ref_res = x + res
    assert torch.equal(res_out, ref_res), seed
    assert_bf16_match(out, rms_norm_ref(ref_res, w, 1e-5), *NEAR, f"rmsnorm seed {seed}")
    out = rms_norm(x, w, 1e-5, out=poisoned(tokens, HIDDEN, dtype=BF16, device=dev))
    assert_bf16_match(out, rms_norm_ref(x, w, 1e-5), *NEAR, f"rmsnorm no residual seed {seed}")
    # Qwen3-style per-head norm on the q/k views of a fused QKV output
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, device=dev).to(BF16)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    wh = (1 + 0.3 * torch.randn(HEAD_DIM, generator=g, device=dev)).to(BF16)
    for t in (q, k):
        out = rms_norm(t, wh, 1e-6, out=poisoned(*t.shape, dtype=BF16, device=dev))
        assert_bf16_match(out, rms_norm_ref(t, wh, 1e-6), *NEAR, f"per-head norm seed {seed}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
def test_gpu_silu_and_mul(tokens):
    g, seed = fresh_generator()
    x = (4 * torch.randn(tokens, 2 * INTER, generator=g, device="cuda")).to(BF16)
    out = silu_and_mul(x, out=poisoned(tokens, INTER, dtype=BF16, device="cuda"))
    assert not torch.isnan(out).any(), seed
    assert_bf16_match(out, silu_and_mul_ref(x), *NEAR, f"silu_and_mul seed {seed}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
def test_gpu_rotary(tokens):
    g, seed = fresh_generator()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(HEAD_DIM, 131072, 500000.0, scaling).cuda()
    positions = torch.randint(0, 131072, (tokens,), generator=g, device="cuda")
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, device="cuda").to(BF16)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    q_out, k_out = apply_rotary(positions, q, k, rope.cos, rope.sin,
                                q_out=poisoned(*q.shape, dtype=BF16, device="cuda"),
                                k_out=poisoned(*k.shape, dtype=BF16, device="cuda"))
    ref_q, ref_k = apply_rotary_ref(positions, q, k, rope.cos, rope.sin)
    for out, x, ref in ((q_out, q, ref_q), (k_out, k, ref_k)):
        assert not torch.isnan(out).any(), seed
        assert_rotary_bf16(out, x, rope_truth(positions, x, rope), ref)
    # fp32 inputs: agrees with the fp32 reference to fp32 rounding
    qf, kf = q.float(), k.float()
    q32, k32 = apply_rotary(positions, qf, kf, rope.cos, rope.sin)
    ref_q, ref_k = apply_rotary_ref(positions, qf, kf, rope.cos, rope.sin)
    torch.testing.assert_close(q32, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k32, ref_k, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_kernels_capture_in_cuda_graphs_and_layers_dispatch(monkeypatch):
    """Each launcher records into a CUDA graph (no host syncs) and replays on new inputs; the
    layers send CUDA tensors to the kernels."""
    dev, T = "cuda", 64
    x = torch.randn(T, HIDDEN, device=dev, dtype=BF16)
    res = torch.randn(T, HIDDEN, device=dev, dtype=BF16)
    w = torch.randn(HIDDEN, device=dev, dtype=BF16)
    gu = torch.randn(T, 2 * INTER, device=dev, dtype=BF16)
    rope = RotaryEmbedding(HEAD_DIM, 4096, 500000.0, None).cuda()
    pos = torch.randint(0, 4096, (T,), device=dev)
    q = torch.randn(T, HEADS, HEAD_DIM, device=dev, dtype=BF16)
    k = torch.randn(T, KV_HEADS, HEAD_DIM, device=dev, dtype=BF16)

    def step():
        return rms_norm(x, w, 1e-5, res), silu_and_mul(gu), apply_rotary(pos, q, k, rope.cos, rope.sin)

    graph, ((out, res_out), act, (q_out, k_out)) = capture_cuda_graph(step)
    for t in (x, res, gu, q, k):
        t.copy_(torch.randn_like(t))
    pos.copy_(torch.randint(0, 4096, (T,), device=dev))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res_out, x + res)
    assert_bf16_match(out, rms_norm_ref(x + res, w, 1e-5), *NEAR, "graph rmsnorm")
    assert_bf16_match(act, silu_and_mul_ref(gu), *NEAR, "graph silu")
    assert_rotary_bf16(q_out, q, rope_truth(pos, q, rope))
    assert_rotary_bf16(k_out, k, rope_truth(pos, k, rope))

    # the layers, on CUDA tensors, go through the kernels (counted) and return what they return
    calls = []
    for mod, name, fn in ((norm, "rms_norm", rms_norm), (activation, "silu_and_mul", silu_and_mul)):
        assert getattr(mod, name) is fn
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    layer = RMSNorm(HIDDEN, 1e-5).cuda().to(BF16)
    layer.weight.data.copy_(w)
    o, r = layer(x, res)
    assert torch.equal(o, out) and torch.equal(r, res_out)
    assert torch.equal(SiluAndMul()(gu), act)
    assert calls == ["rms_norm", "silu_and_mul"]
