"""Mixture of experts: the routing and expert kernels against their torch references in Triton's
interpreter at ragged expert loads; the engine with MoE models (batch invariance, preemption and
chunked prefill, sampling); checkpoint loading errors; the layer's cost.
(HF-exactness of Mixtral, Qwen2-MoE and Qwen3-MoE: tests/models/test_hf_parity.py.)"""
import json
import shutil

import pytest
import torch
import triton

from ridge import LLM, SamplingParams
from ridge.kernels.moe_gemm import GroupedTiles, SmallTiles, fused_moe_grouped, fused_moe_ref, fused_moe_small
from ridge.kernels.moe_route import align_by_expert, align_by_expert_ref, max_blocks, route_topk, route_topk_ref
from ridge.layers.cost import StepShape
from ridge.layers.moe import FusedMoE
from tests.tests_support import prompt_of
from tests.engine.test_batching import assert_pool_free

interpret = pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="Triton kernels on a CPU need TRITON_INTERPRET=1")


def _loads(T, E, k, kind, gen):
    """Expert choices [T, k] (distinct per token) with a given load pattern."""
    if kind == "uniform":
        return torch.rand(T, E, generator=gen).topk(k, dim=-1).indices.int()
    if kind == "hot":          # expert 1 in every token (it takes all T), the rest spread over E // 2
        rest = torch.rand(T, E // 2, generator=gen)
        rest[:, 1] = -1.0
        return torch.cat([torch.ones(T, 1, dtype=torch.int64), rest.topk(k - 1, dim=-1).indices], 1).int()
    if kind == "one":          # the same k experts for every token: all other experts get 0 rows
        return torch.arange(k).repeat(T, 1).int() + 2
    raise ValueError(kind)


@interpret
@pytest.mark.parametrize("T,E,k,renorm", [(1, 8, 2, True), (7, 128, 8, False), (33, 60, 6, True), (4, 16, 1, False)])
def test_route_topk_matches_reference(T, E, k, renorm):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T))
    w, e = route_topk(logits, k, renorm)
    wr, er = route_topk_ref(logits, k, renorm)
    assert torch.equal(e, er)
    torch.testing.assert_close(w, wr, atol=1e-6, rtol=1e-6)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(T))


@interpret
@pytest.mark.parametrize("kind", ["uniform", "hot", "one"])
@pytest.mark.parametrize("T,E,k,bm", [(1, 8, 2, 16), (24, 8, 2, 16), (40, 16, 4, 32), (130, 64, 8, 16)])
def test_align_by_expert_matches_reference(T, E, k, bm, kind):
    experts = _loads(T, E, k, kind, torch.Generator().manual_seed(T + E))
    got, ref = align_by_expert(experts, E, bm), align_by_expert_ref(experts, E, bm)
    for g, r, name in zip(got, ref, ("pair_order", "block_expert", "expert_counts")):
        assert torch.equal(g, r), name
    order, blocks, counts = got
    P = T * k
    assert order.numel() == max_blocks(P, E, bm) * bm
    assert sorted(order[order < P].tolist()) == list(range(P))         # every pair once
    for b, e in enumerate(blocks.tolist()):                              # each tile holds one expert's pairs
        rows = order[b * bm:(b + 1) * bm]
        rows = rows[rows < P].long()
        assert e >= 0 or rows.numel() == 0
        assert (experts.reshape(-1)[rows] == e).all()
    assert counts.tolist() == torch.bincount(experts.reshape(-1).long(), minlength=E).tolist()


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["uniform", "hot", "one"])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 16, 4), (40, 8, 2)])
def test_expert_kernels_match_reference(T, E, k, kind, dtype):
    g = torch.Generator().manual_seed(7 * T + E)
    H, inter = 64, 48
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.2).to(dtype)
    experts = _loads(T, E, k, kind, g)
    weights = torch.rand(T, k, generator=g)
    ref = fused_moe_ref(x, w13, w2, weights, experts).float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    small = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(16, 32, 4, 1),) * 2)
    torch.testing.assert_close(small.float(), ref, **tol)
    for bm, fuse_sum in ((16, True), (32, True), (16, False)):
        grouped = fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(bm, 16, 32, 4, 1),) * 2, fuse_sum)
        torch.testing.assert_close(grouped.float(), ref, **tol)


@interpret
@pytest.mark.parametrize("T,k", [(3, 2), (12, 2)])
def test_fp8_expert_kernels_match_the_dequantized_reference(T, k):
    """Weight-only FP8 experts: K (160) and 2I (288) ragged against the 128 x 128 scale blocks, and
    a block straddling an expert's gate and up rows."""
    from ridge.layers.moe import quantize_experts
    g = torch.Generator().manual_seed(3 + T)
    E, H, inter = 8, 160, 144
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = quantize_experts((torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(torch.bfloat16))
    w2 = quantize_experts((torch.randn(E, H, inter, generator=g) * 0.2).to(torch.bfloat16))
    assert w13.q.dtype == torch.float8_e4m3fn and w13.scale.shape == (E, 3, 2)
    experts, weights = _loads(T, E, k, "uniform", g), torch.rand(T, k, generator=g)
    ref = fused_moe_ref(x, w13, w2, weights, experts).float()
    small = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(16, 32, 4, 1),) * 2)
    torch.testing.assert_close(small.float(), ref, atol=2e-2, rtol=2e-2)
    grouped = fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(16, 16, 32, 4, 1),) * 2)
    torch.testing.assert_close(grouped.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="divides 128"):
        fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(16, 256, 4, 1),) * 2)


def _int4_fp32(w):
    """Int4Experts dequantized in fp32, unrounded: (q - z) * s."""
    from ridge.kernels.int4_matmul import dequantize_int4
    return torch.stack([dequantize_int4(q.T, s.T.float(), z.T.float(), 128).T for q, s, z in zip(w.q, w.scale, w.zero)])


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["uniform", "hot", "one"])
@pytest.mark.parametrize("T,k", [(3, 2), (24, 2)])
def test_int4_expert_kernels_match_the_dequantized_reference(T, k, kind, dtype):
    """INT4 experts (codes packed along K, a scale and zero point per 128 inputs): K of gate/up 160
    (a short last group), I = 72 (down's K one short group; 2I = 144 ragged against the 32-row tiles);
    uniform load, one expert taking every token, experts with none."""
    from ridge.kernels.moe_gemm import Int4Experts, dequantize_experts
    from ridge.layers.moe import quantize_experts_int4
    g = torch.Generator().manual_seed(5 + T)
    E, H, inter = 8, 160, 72
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = quantize_experts_int4((torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(dtype))
    w2 = quantize_experts_int4((torch.randn(E, H, inter, generator=g) * 0.2).to(dtype))
    assert isinstance(w13, Int4Experts) and w13.q.shape == (E, 2 * inter, H // 8) and w13.scale.shape == (E, 144, 2)
    assert w13.shape == (E, 2 * inter, H) and w2.zero.dtype == dtype
    experts, weights = _loads(T, E, k, kind, g), torch.rand(T, k, generator=g)
    ref = fused_moe_ref(x, w13, w2, weights, experts).float()
    # the reference is the dequantized experts' float MoE
    assert torch.equal(ref, fused_moe_ref(x, dequantize_experts(w13), dequantize_experts(w2), weights, experts).float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if T <= 16:          # the small path serves only steps of <= SMALL_MAX_TOKENS (16) tokens
        small = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(32, 32, 4, 1),) * 2)
        # the small path scales each group's fp32 sums (ridge/kernels/moe_int4.py) instead of rounding
        # every dequantized weight to the activation dtype: in bf16 it is held to the unrounded dequantized
        # MoE in fp32, no farther from it than twice the reference (whose rounded weights put it ~1 ulp off)
        # (gate/up with 128-wide K tiles runs on tensor cores: checked too, its second tile a short one)
        small_mma = fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(32, 128, 4, 1), SmallTiles(32, 32, 4, 1)))
        exact = fused_moe_ref(x.float(), _int4_fp32(w13), _int4_fp32(w2), weights, experts)
        for got in (small, small_mma):
            if dtype == torch.float32:
                torch.testing.assert_close(got.float(), ref, **tol)
            else:
                assert (got.float() - exact).abs().max() <= 2 * (ref - exact).abs().max()
    # the grouped path: the generic tile loads (32-wide K) and the nibble planes (one 128-wide group a
    # K step, each weight rounded as the reference's), both held to the reference
    for bm, bk, fuse_sum in ((16, 32, True), (32, 32, False), (16, 128, True), (32, 128, False)):
        grouped = fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(bm, 32, bk, 4, 1),) * 2, fuse_sum)
        torch.testing.assert_close(grouped.float(), ref, **tol)
    with pytest.raises(ValueError, match="Int4Experts need tiles whose K width divides 128"):
        fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(16, 32, 256, 4, 1),) * 2)


def test_int4_experts_quantize_as_the_dense_layers_do():
    """Each expert's codes, scales and zero points are the dense INT4 grid's (formats.quantize_rtn, group
    128); a short last group quantizes as if padded with zeros; K not a multiple of 8 is refused."""
    from ridge.kernels.moe_gemm import dequantize_experts
    from ridge.layers.quant.formats import dequantize, quantize_rtn
    from ridge.layers.moe import quantize_experts_int4
    w = torch.randn(3, 16, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = dequantize_experts(quantize_experts_int4(w))
    for e in range(3):
        q, s, z = quantize_rtn(w[e], 128, scale_dtype=torch.bfloat16)
        assert torch.equal(got[e], dequantize(q, s, z, 128).to(torch.bfloat16))
    short = dequantize_experts(quantize_experts_int4(w[:, :, :200]))
    padded = dequantize_experts(quantize_experts_int4(torch.nn.functional.pad(w[:, :, :200], (0, 56))))
    assert torch.equal(short, padded[:, :, :200])
    assert (short.float() - w[:, :, :200].float()).abs().max() < 0.3          # half a step of a ~7-sigma range / 15
    with pytest.raises(ValueError, match="not a multiple of 8"):
        quantize_experts_int4(w[:, :, :100])


@pytest.mark.parametrize("name", ["qwen3moe", "deepseekv3"])
def test_fp8_quantization_of_moe_models(checkpoints, name):
    """--quantization fp8 on an MoE model: the experts are held in e4m3 (their float copies freed),
    the dense projections as FP8 linears, the router in float; the logits stay close to the float
    model's."""
    fp8, ref = (_moe_llm(checkpoints, name, quantization=q) for q in ("fp8", None))
    model = fp8.engine.runner.model
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert moe.w13_fp8.q.dtype == torch.float8_e4m3fn and moe.w13_weight.numel() == 0
    block = next(m.mlp for m in model.model.layers if hasattr(m.mlp, "experts"))
    assert block.gate.quant_method is None
    float_moe = next(m for m in ref.engine.runner.model.modules() if isinstance(m, FusedMoE))
    assert moe.cost(StepShape((1,), (1,)))[1].param_bytes < float_moe.cost(StepShape((1,), (1,)))[1].param_bytes / 1.9
    ids = torch.tensor(prompt_of(24))
    lp = []
    for llm in (fp8, ref):
        r = llm.engine.runner
        meta = r.metadata(list(range(len(ids))), [0, len(ids)], [len(ids)], [list(range(4))])
        lp.append(r.model.compute_logits(r.model(ids, torch.arange(len(ids)), r.layer_caches, meta))[-1].log_softmax(-1))
    kl = torch.sum(lp[1].exp() * (lp[1] - lp[0])).item()
    assert 0 < kl < 2e-2, kl
    out = fp8.generate([prompt_of(9)], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_expert_kernels_refuse_mismatched_shapes():
    x, w13, w2 = torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 5)
    e, w = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_moe_small(x, w13, w2, w, e)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe_grouped(x, w13, torch.randn(4, 8, 6), w, e, (GroupedTiles(16, 16, 32, 4, 1), GroupedTiles(32, 16, 32, 4, 1)))


def _moe_llm(checkpoints, name="qwen3moe", **kw):
    return LLM(checkpoints(name), device="cpu", show_progress=False, max_model_len=512, **kw)


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe"])
def test_batch_invariance_with_moe(checkpoints, name):
    llm = _moe_llm(checkpoints, name)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    target = prompt_of(13, salt=99)
    alone = llm.generate([target], greedy, use_tqdm=False)[0].outputs[0].token_ids
    others = [prompt_of(n, salt=i) for i, n in enumerate([5, 60, 1, 33, 8, 100, 2, 17, 45])]
    outs = llm.generate(others[:4] + [target] + others[4:], greedy, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone
    assert_pool_free(llm)


def test_preemption_chunking_and_sampling_with_moe(checkpoints):
    prompts = [prompt_of(30 + (i * 37) % 70, salt=i) for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=20 + i % 5, ignore_eos=True) for i in range(12)]
    ample = _moe_llm(checkpoints)
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    page_bytes = ample.engine.runner.kv_bytes_per_page()
    tight = _moe_llm(checkpoints, kv_cache_memory=20 * page_bytes, max_num_batched_tokens=32)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    assert_pool_free(tight)
    # seeded sampling with penalties, top-k/p, logprobs and n: reproducible, pages returned
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, repetition_penalty=1.2, seed=5, max_tokens=12,
                        logprobs=2, n=2)
    a, b = (ample.generate([prompts[0]], sp, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(len(c.logprobs) == 12 for c in a.outputs)
    assert_pool_free(ample)


def test_moe_checkpoint_errors_name_the_tensor(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoints("qwen3moe")
    bad = tmp_path / "missing"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        LLM(str(bad), device="cpu", show_progress=False)
    tensors = load_file(str(src) + "/model.safetensors")
    tensors["model.layers.0.mlp.experts.2.down_proj.weight"] = tensors["model.layers.0.mlp.experts.2.down_proj.weight"][:-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj\.weight.*shape"):
        LLM(str(bad), device="cpu", show_progress=False)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_experts_per_tok"] = (cfg.get("num_experts") or cfg["num_local_experts"]) + 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LLM(str(bad), device="cpu", show_progress=False)
    from ridge.layers.quant.formats import compressed_tensors_config
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 2,
                                                 "quantization_config": compressed_tensors_config(128, False)}))
    with pytest.raises(ValueError, match="compressed-tensors.*checkpoints of mixture-of-experts models"):
        LLM(str(bad), device="cpu", show_progress=False)
    from ridge.quantize import quantize
    for method in ("rtn", "fp8"):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            quantize(src, str(tmp_path / method), method=method, device="cpu")
        assert not (tmp_path / method).exists()


def test_dummy_moe_model_runs(checkpoints):
    llm = _moe_llm(checkpoints, "mixtral", load_format="dummy")
    out = llm.generate([prompt_of(9)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    w = llm.engine.runner.model.model.layers[0].mlp.experts.w13_weight
    assert w.std().item() == pytest.approx(0.02, rel=0.05)


def test_moe_cost_counts_the_experts_selected():
    moe = FusedMoE(num_experts=8, top_k=2, hidden_size=16, expert_size=8, renormalize=True)
    expert_bytes = 3 * 16 * 8 * moe.w13_weight.element_size()
    one = StepShape((1,), (1,))
    # no step yet: the uniform-routing expectation (1 token: exactly top_k experts)
    assert sum(c.param_bytes for c in moe.cost(one)) == pytest.approx(2 * expert_bytes)
    for p in moe.parameters():
        p.data.normal_()
    logits = torch.full((6, 8), -10.0)
    logits[:, 3], logits[:, 5] = 5.0, 4.0                 # every token picks experts 3 and 5
    moe(logits, torch.randn(6, 16))
    assert moe.tokens_per_expert(6) == [0, 0, 0, 6, 0, 6, 0, 0]
    six = StepShape((6,), (6,))
    costs = {c.name: c for c in moe.cost(six)}
    assert costs["moe_experts"].param_bytes == 2 * expert_bytes
    assert costs["moe_experts"].flops == 2 * 12 * 3 * 16 * 8 + 5 * 12 * 8 + 2 * 12 * 16      # 12 routed pairs
    assert costs["moe_experts"].expert_load == (6, 1.5, 6)
    # another token count: the expectation again, between top_k and all experts
    seven = moe.cost(StepShape((7,), (7,)))
    assert 2 * expert_bytes < sum(c.param_bytes for c in seven) < 8 * expert_bytes
    assert seven[-1].expert_load is None


def test_roofline_reports_uneven_expert_load(checkpoints):
    from ridge.roofline.costs import merge
    from ridge.roofline.diagnose import diagnose_step
    from ridge.roofline.timeline import StepTiming
    from ridge.utils.ceilings import Ceilings

    llm = _moe_llm(checkpoints)
    model = llm.engine.runner.model
    for layer in model.model.layers:
        layer.mlp.experts.routed = torch.tensor([[0, 1, 2, 3]] * 120 + [[4, 5, 6, 7]] * 8, dtype=torch.int32)
    shape = StepShape((128,), (128,))
    costs = merge(model.cost(shape))
    assert next(c for c in costs if c.name == "moe_experts").expert_load == (120, 32.0, 8)
    ceil = Ceilings("cpu", "cpu", "k", 1e11, {"fp32": 1e12}, 1e-6)
    timing = StepTiming(step_s=1e-2, op_s={c.name: 1e-4 for c in costs}, kernels={c.name: 1 for c in costs},
                        calls={c.name: 1 for c in costs})
    rep = diagnose_step("prefill", shape, costs, timing, ceil, 1, 128, 128)
    assert any("uneven" in n and "up to 120" in n and "3.8x" in n for n in rep.notes)
    # at a few rows an expert (decode) every expert fits one tile: no note
    for layer in model.model.layers:
        layer.mlp.experts.routed = torch.tensor([[0, 1, 2, 3]] * 3 + [[4, 5, 6, 7]], dtype=torch.int32)
    small = StepShape((1,) * 4, (9,) * 4)
    rep = diagnose_step("decode", small, merge(model.cost(small)), timing, ceil, 4, 9, 1)
    assert not any("uneven" in n for n in rep.notes)


def test_the_expert_plan_times_only_the_buckets_a_step_can_reach(monkeypatch, tmp_path):
    """The plan is measured for steps up to the engine's budget (and one bucket past the small path);
    a later engine with a larger budget measures only the buckets the cache lacks."""
    import ridge.layers.moe_tuning as mt

    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    asked = []

    def fake_measure(w13, w2, top_k, buckets):
        asked.append(tuple(buckets))
        tiles = [list(mt.GROUPED_CANDIDATES[0])] * 2
        return {str(b): {"path": "grouped", "tiles": tiles, "us": {"grouped": float(b)}} for b in buckets}

    monkeypatch.setattr(mt, "measure", fake_measure)
    w13, w2 = torch.empty(4, 32, 16), torch.empty(4, 16, 16)
    plan = mt.moe_plan(w13, w2, 2, max_tokens=100)
    assert asked == [(1, 2, 4, 8, 16, 32, 64, 128)] and plan.buckets[-1] == 128
    assert plan.us[plan.buckets[1]] == {"grouped": 2.0}
    assert mt.moe_plan(w13, w2, 2, max_tokens=4).buckets[-1] == 128 and len(asked) == 1   # all cached
    assert mt.buckets_for(4)[-1] == 32              # past the small path's 16 tokens
    full = mt.moe_plan(w13, w2, 2)
    assert asked[1] == tuple(b for b in mt.BUCKETS if b > 128) and full.buckets == list(mt.BUCKETS)
    assert full.choice(100_000) == full.table[mt.BUCKETS[-1]] and full.choice(3) == full.table[4]
