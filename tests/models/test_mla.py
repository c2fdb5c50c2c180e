"""DeepSeek-V2/V3 on the CPU: the latent cache's size, the engine's paging features over it,
DeepSeek's routing, the Triton backend's static decode and verify steps over the latent cache, and
clear errors. HF parity of the models: tests/models/test_hf_parity.py; the latent-attention kernels
against their reference: tests/kernels/test_mla_kernels.py."""
import json
import math
import shutil

import pytest
import torch
import triton

from ridge import LLM, SamplingParams
from ridge.kernels.moe_route import route_grouped_ref
from ridge.layers.attention import TORCH_BACKEND
from ridge.layers.cost import StepShape
from ridge.layers.mla import LatentAttention
from ridge.layers.rotary import RotaryEmbedding
from ridge.model_config import GroupedRouting, ModelConfig
from ridge.utils.random_checkpoint import PRESETS
from tests.tests_support import prompt_of
from tests.engine.test_batching import assert_pool_free

interpret = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                               reason="Triton kernels on a CPU need TRITON_INTERPRET=1")


def _llm(checkpoints, name="deepseekv3", **kw):
    return LLM(checkpoints(name), device="cpu", show_progress=False, max_model_len=512, **kw)


def test_latent_cache_holds_one_row_a_token_a_layer(checkpoints):
    llm = _llm(checkpoints, "deepseekv2")
    runner, cfg = llm.engine.runner, llm.engine.runner.model_cfg
    r, rope = cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    assert runner.kv_cache.shape[1:] == (1, runner.kv_cache.shape[2], llm.engine.cfg.page_size, 1, r + rope)
    assert runner.kv_bytes_per_page() == cfg.num_layers * llm.engine.cfg.page_size * (r + rope) * 4
    # DeepSeek-V2-Lite's shape: 576 values a token a layer, for all 16 heads; its YaRN scale
    lite = ModelConfig.from_dict({**PRESETS["deepseek-v2-lite"], "architectures": ["DeepseekV2ForCausalLM"]})
    assert lite.cache_row == (1, 1, 576)
    m = 0.1 * 0.707 * math.log(40) + 1
    assert lite.mla.softmax_scale == pytest.approx(192 ** -0.5 * m * m)


@pytest.mark.parametrize("name", ["deepseekv2", "deepseekv3"])
def test_preemption_chunking_and_prefix_caching_over_the_latent_cache(checkpoints, name):
    shared = prompt_of(40, salt=7)
    prompts = [shared + prompt_of(5 + i, salt=i) for i in range(4)] + \
              [prompt_of(30 + (i * 37) % 70, salt=10 + i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=12 + i % 5, ignore_eos=True) for i in range(12)]
    ample = _llm(checkpoints, name, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params, use_tqdm=False)]
    page_bytes = ample.engine.runner.kv_bytes_per_page()
    tight = _llm(checkpoints, name, kv_cache_memory=20 * page_bytes, max_num_batched_tokens=32,
                 enable_prefix_caching=True)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    assert_pool_free(tight)
    cached = _llm(checkpoints, name, enable_prefix_caching=True)
    for p, w in zip(prompts[:4], want[:4]):         # one at a time: each after the first hits the shared prefix
        assert cached.generate([p], params[0], use_tqdm=False)[0].outputs[0].token_ids == w[:params[0].max_tokens]


def test_grouped_routing_keeps_to_the_best_groups():
    logits = torch.tensor([[5.0, 0, 0, 0, 0, 0, 4.5, 4.4],    # groups of 2: best are 0 (5.0) and 3 (4.5 / 4.4)
                           [0, 0, 3.0, 2.9, 0, 0, 0, 1.0]])
    v2 = GroupedRouting("softmax", n_group=4, topk_group=2, group_score="max", scale=2.0, score_bias=False)
    w, e = route_grouped_ref(logits, 2, False, v2)
    assert [sorted(r) for r in e.tolist()] == [[0, 6], [2, 3]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(w, probs.gather(1, e.long()) * 2.0)
    # V3: sigmoid scores; the bias moves the choice but not the weights; groups by their top-2 sum
    v3 = GroupedRouting("sigmoid", n_group=4, topk_group=1, group_score="top2", scale=1.0, score_bias=True)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0, 10.0])
    w, e = route_grouped_ref(logits, 2, True, v3, bias)
    assert [sorted(r) for r in e.tolist()] == [[6, 7], [6, 7]]
    s = logits.sigmoid().gather(1, e.long())
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True))


def test_latent_attention_cost_reads_each_row_once_for_all_heads():
    rotary = RotaryEmbedding(8, 64, 10000.0, None)
    attn = LatentAttention(num_heads=16, kv_lora_rank=32, nope_dim=16, rope_dim=8, v_dim=16, scale=0.2, rotary=rotary,
                           backend=TORCH_BACKEND)
    step = StepShape((1, 1), (100, 300), dtype=torch.bfloat16)
    write, att = attn.cost(step, kv_b_bytes=1000)
    assert att.kv_bytes == (100 + 300) * (32 + 8) * 2            # not x 16 heads
    assert att.param_bytes == 1000
    assert att.flops == 2 * 2 * 16 * (16 * 32 + 32 * 16) + 16 * 400 * (4 * 32 + 2 * 8)
    assert write.kv_bytes == 2 * (32 + 8) * 2
    # a prefill step runs the expanded form: the context's latents up-projected once, 24-wide keys
    expand, att = attn.cost(StepShape((1, 50), (100, 50), dtype=torch.bfloat16), kv_b_bytes=1000)[1:]
    assert expand.flops == 2 * 150 * 32 * 16 * (16 + 16) and expand.kv_bytes == 150 * (32 + 8) * 2
    assert att.flops == 16 * (100 + 50 * 51 // 2) * (2 * (16 + 8) + 2 * 16)


def test_deepseek_errors_are_clear(checkpoints, tmp_path):
    src = checkpoints("deepseekv3")
    with pytest.raises(ValueError, match="latent attention"):
        LLM(src, device="cpu", show_progress=False, kv_cache_dtype="fp8")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for key, value, match in (("kv_lora_rank", None, "kv_lora_rank"), ("qk_rope_head_dim", 7, "even"),
                              ("topk_group", 5, "routing does not fit")):
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=match):
            LLM(str(bad), device="cpu", show_progress=False)


@interpret
def test_static_decode_path_with_the_kernels_matches_the_reference(checkpoints):
    """The Triton backend's padded static decode path (what a CUDA graph replays) over the latent
    cache: the latent write and the absorbed decode kernel give the reference engine's tokens. One
    decoder layer (DeepSeek-V2's dense one): each token is interpreted kernel programs in every layer."""
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((3, 21, 40))]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(checkpoints, "deepseekv2-1layer").generate(prompts, greedy,
                                                                                           use_tqdm=False)]
    llm = _llm(checkpoints, "deepseekv2-1layer", attention_backend="triton")
    assert llm.engine.runner.decode_graphs is not None          # the static path is in use
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    assert_pool_free(llm)


@interpret
def test_speculative_verify_steps_over_the_latent_cache(checkpoints):
    """n-gram speculation with the Triton backend: verify steps (several tokens a sequence) run
    MLA's expanded form eagerly, so the tokens are plain decoding's. One decoder layer, as above;
    on it, these two prompts' continuations repeat themselves: 4 drafts, 5 of their tokens accepted."""
    prompts = [prompt_of(8, salt=6) * 3, prompt_of(21, salt=5)]      # repeats give the n-gram drafts
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(checkpoints, "deepseekv2-1layer").generate(prompts, greedy,
                                                                                           use_tqdm=False)]
    spec = _llm(checkpoints, "deepseekv2-1layer", attention_backend="triton",
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert spec.engine.runner.verify_graphs is None
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)] == want
    assert spec.engine.stats().spec_num_drafts > 0                   # verify steps ran


def test_deepseek_v3_multi_token_prediction_layers_are_skipped(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file
    src = checkpoints("deepseekv3")
    ckpt = tmp_path / "mtp"
    shutil.copytree(src, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(4, 8)        # as V3 checkpoints ship them
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = (LLM(p, device="cpu", show_progress=False).generate([prompt_of(9)], greedy, use_tqdm=False)
            for p in (src, str(ckpt)))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_yarn_factor_is_inferred_as_transformers_does():
    raw = {**PRESETS["deepseek-v2-lite"], "architectures": ["DeepseekV2ForCausalLM"], "max_position_embeddings": 65536}
    raw["rope_parameters"] = {**raw["rope_parameters"], "factor": None}
    assert ModelConfig.from_dict(raw).rope_scaling["factor"] == 16.0
    del raw["rope_parameters"]["original_max_position_embeddings"]
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelConfig.from_dict(raw)
