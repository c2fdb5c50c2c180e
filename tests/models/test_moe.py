"""Mixture of experts: the engine with MoE models (batch invariance, preemption and chunked prefill,
sampling), experts quantized as the dense layers are, checkpoint loading errors, the layer's cost.
(The routing and expert kernels against their references: tests/kernels/test_moe_kernels.py.)
(HF-exactness of Mixtral, Qwen2-MoE and Qwen3-MoE: tests/models/test_hf_parity.py.)"""
import json
import shutil

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.layers.cost import StepShape
from ridge.layers.moe import FusedMoE
from tests.tests_support import prompt_of
from tests.engine.test_batching import assert_pool_free


def test_int4_experts_quantize_as_the_dense_layers_do():
    """Each expert's codes, scales and zero points are the dense INT4 grid's (formats.quantize_rtn, group
    128); a short last group quantizes as if padded with zeros; K not a multiple of 8 is refused."""
    from ridge.kernels.moe_gemm import dequantize_experts
    from ridge.layers.quant.int4.formats import dequantize, quantize_rtn
    from ridge.layers.quant.int4.experts import quantize_experts_int4
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
    assert moe.weights()[0].q.dtype == torch.float8_e4m3fn and moe.w13_weight.numel() == 0
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
    from ridge.layers.quant.int4.formats import compressed_tensors_config
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
