"""MoE on the GPU: the expert kernels at the Qwen3-30B-A3B and Mixtral-8x7B layer shapes against
the torch reference, both paths; a random Qwen3-MoE checkpoint (transformers, bf16) through the
engine against HF's greedy tokens (first divergence within HF's top-5), with decode CUDA graphs
and overlapped decode on and off giving identical outputs, and batch invariance."""
import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.kernels.moe_gemm import GroupedTiles, SmallTiles, fused_moe_grouped, fused_moe_ref, fused_moe_small

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("E,k,H,inter", [(128, 8, 2048, 768), (8, 2, 4096, 14336)], ids=["qwen3-30b-a3b", "mixtral"])
def test_expert_kernels_at_model_shapes(E, k, H, inter):
    g = torch.Generator(device="cuda").manual_seed(E)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, inter, device="cuda", generator=g) * 0.02).bfloat16()
    for T in (1, 5, 16, 64, 700):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(T, E, device="cuda", generator=g)
        weights, experts = torch.softmax(logits, -1).topk(k, -1)
        experts = experts.int()
        if T == 64:
            experts[:, 0] = 0 if k > 1 else experts[:, 0]       # one expert in every token
        ref = fused_moe_ref(x, w13, w2, weights, experts).float()
        outs = [fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(64, 64, 64, 4, 3),) * 2),
                fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(16, 128, 64, 4, 4),) * 2),
                fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(64, 64, 64, 4, 3),) * 2, False)]
        if T <= 16:
            outs.append(fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(16, 128, 4, 1),) * 2))
        for out in outs:
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel < 1e-2, (T, rel)


@pytest.mark.parametrize("E,k,H,inter", [(64, 6, 2048, 1408), (128, 8, 2048, 768)], ids=["deepseek-v2-lite", "qwen3"])
def test_fp8_expert_kernels_at_model_shapes(E, k, H, inter):
    """Weight-only FP8 experts (DeepSeek-V2-Lite's 1408 is not a multiple of 128) against the
    reference on the dequantized weights."""
    from ridge.layers.quant.fp8.experts import quantize_experts
    g = torch.Generator(device="cuda").manual_seed(E + 1)
    w13 = quantize_experts((torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02).bfloat16())
    w2 = quantize_experts((torch.randn(E, H, inter, device="cuda", generator=g) * 0.02).bfloat16())
    for T in (1, 8, 300):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        weights, experts = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(k, -1)
        experts = experts.int()
        ref = fused_moe_ref(x, w13, w2, weights, experts).float()
        outs = [fused_moe_grouped(x, w13, w2, weights, experts, (GroupedTiles(64, 64, 64, 4, 3),) * 2)]
        if T <= 16:
            outs.append(fused_moe_small(x, w13, w2, weights, experts, (SmallTiles(16, 128, 4, 3),) * 2))
        for out in outs:
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel < 1e-2, (T, rel)


@pytest.mark.parametrize("E,k,H,inter", [(64, 6, 2048, 1408), (128, 8, 2048, 768)], ids=["deepseek-v2-lite", "qwen3"])
def test_int4_expert_kernels_at_model_shapes(E, k, H, inter):
    """INT4 experts (group 128, RTN at load) against the reference on the dequantized weights, every
    small-batch and grouped tile the plan may pick; one token batch with an expert in every token."""
    from ridge.layers.quant.int4.experts import quantize_experts_int4
    from ridge.layers.moe_tuning import (GROUPED_CANDIDATES, INT4_GROUPED_CANDIDATES, INT4_SMALL_CANDIDATES,
                                         SMALL_CANDIDATES)
    from ridge.kernels.moe_gemm import small_down_block_k, tiles_fit
    from triton.runtime.errors import OutOfResources
    g = torch.Generator(device="cuda").manual_seed(E + 2)
    w13 = quantize_experts_int4((torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02).bfloat16())
    w2 = quantize_experts_int4((torch.randn(E, H, inter, device="cuda", generator=g) * 0.02).bfloat16())
    for T in (1, 8, 64, 300):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        weights, experts = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(k, -1)
        experts = experts.int()
        if T == 64:
            experts[:, 0] = 0                                   # one expert takes every token
        ref = fused_moe_ref(x, w13, w2, weights, experts).float()
        # a tile whose INT4 unpacking outgrows shared memory is not run (the tuner times it as inf);
        # every BLOCK_M the plan chooses among keeps at least one tile that runs
        outs, ran = [], set()
        for c in GROUPED_CANDIDATES + INT4_GROUPED_CANDIDATES:      # the latter: the nibble-plane loop
            try:
                outs += [fused_moe_grouped(x, w13, w2, weights, experts, (c, c), fuse_sum=f) for f in (True, False)
                         if tiles_fit(w13, c.block_k)]
                ran.add(c.block_m)
            except OutOfResources:
                pass
        assert ran == {c.block_m for c in GROUPED_CANDIDATES}
        if T <= 16:
            outs += [fused_moe_small(x, w13, w2, weights, experts, (c, c)) for c in SMALL_CANDIDATES
                     if tiles_fit(w13, c.block_k, small_down_block_k(c, k))]
            # gate/up's tensor-core plane kernel (128-wide K), with the first down tile
            outs += [fused_moe_small(x, w13, w2, weights, experts, (c, SMALL_CANDIDATES[0]))
                     for c in INT4_SMALL_CANDIDATES]
        for out in outs:
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel < 1e-2, (T, rel)


@pytest.mark.parametrize("tiles", [GroupedTiles(64, 64, 64, 4, 3), GroupedTiles(16, 128, 64, 4, 4)])
def test_grouped_top_k_sum_is_batch_invariant(tiles):
    """The down GEMM's fused top-k sum (whichever program arrives last sums in slot order): a
    token's output is bit-identical run to run and whatever else is in the batch."""
    E, k, H, inter = 64, 8, 1024, 256
    g = torch.Generator(device="cuda").manual_seed(3)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, inter, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(2048, H, device="cuda", generator=g).bfloat16()
    weights, experts = torch.softmax(torch.randn(2048, E, device="cuda", generator=g), -1).topk(k, -1)
    experts = experts.int()
    full = fused_moe_grouped(x, w13, w2, weights, experts, (tiles,) * 2)
    for _ in range(3):
        assert torch.equal(fused_moe_grouped(x, w13, w2, weights, experts, (tiles,) * 2), full)
    for T in (17, 300):
        assert torch.equal(fused_moe_grouped(x[:T], w13, w2, weights[:T], experts[:T], (tiles,) * 2), full[:T])


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from ridge.utils.random_checkpoint import make_random_checkpoint
    path = str(tmp_path_factory.mktemp("moe") / "qwen3moe")
    return make_random_checkpoint(path, "qwen3moe", "tiny-g128", dtype=torch.bfloat16, device="cuda", num_experts=32,
                                  num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                                  num_hidden_layers=4)


def prompt_of(n, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + n)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)


def test_moe_engine_matches_transformers_and_graphs_change_nothing(moe_ckpt):
    from transformers import AutoModelForCausalLM
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 100, 37, 300, 1, 64, 9))]
    params = [greedy() if i % 2 else SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    results = []
    for eager, overlap in ((False, True), (True, True), (False, False)):
        with LLM(moe_ckpt, dtype="bfloat16", device="cuda", max_model_len=1024, kv_cache_memory=1 << 30,
                 max_num_seqs=32, show_progress=False, enforce_eager=eager, async_scheduling=overlap) as llm:
            assert (llm.engine.runner.decode_graphs.graphs != {}) == (not eager)
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            if not eager and overlap:
                outs = llm.generate(prompts[:4], greedy(), use_tqdm=False)
                target = prompt_of(13, salt=99)
                alone = llm.generate([target], greedy(), use_tqdm=False)[0].outputs[0]
                batched = llm.generate(prompts + [target], greedy(), use_tqdm=False)[-1].outputs[0]
    assert results[0] == results[1] == results[2]
    hf = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.bfloat16, device_map="cuda").eval()
    for p, o in zip(prompts[:4], outs):
        ids = torch.tensor([p], device="cuda")
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                        eos_token_id=None, pad_token_id=2, output_scores=True, return_dict_in_generate=True)
        ref, top5 = g.sequences[0, len(p):].tolist(), [s[0].topk(5).indices.tolist() for s in g.scores]
        diverge_ok(o.outputs[0].token_ids, ref, top5)
    top5_alone = [sorted(e, key=lambda t: e[t].rank)[:5] for e in alone.logprobs]
    diverge_ok(batched.token_ids, alone.token_ids, top5_alone)


def diverge_ok(got, ref, ref_top5):
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert a in ref_top5[i], f"step {i}: token {a} not in the reference's top-5 {ref_top5[i]}"
            return
    assert len(got) == len(ref)


def test_dummy_qwen3_30b_shape_builds(tmp_path):
    from ridge.utils.random_checkpoint import make_random_checkpoint
    path = make_random_checkpoint(str(tmp_path / "q30"), "qwen3moe", "qwen3-30b-a3b", config_only=True)
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=512, kv_cache_memory=2 << 30,
              max_num_seqs=8, show_progress=False, enforce_eager=True)
    out = llm.generate([prompt_of(20)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert sum(p.numel() for p in llm.engine.runner.model.parameters()) > 30e9
