"""INT4 weights in the running engine (issue 15): the Triton kernel path generates what the torch
reference path does, and prefix caching, every sampling option, n > 1 and logprobs behave as on
the float model holding the same (dequantized) weights; on a GPU, CUDA-graph decode and the
overlapped step give the eager engine's tokens.

The float twin is `quantization="int4"`'s own round-to-nearest (group 128, scales in the model's
dtype) dequantized into a plain checkpoint, so any difference is the engine's, not the weights'.
"""
import os

import pytest
import torch
from safetensors.torch import load_file

from ridge import LLM, SamplingParams
from ridge.layers.quant.int4 import formats as F
from ridge.utils.random_checkpoint import make_random_checkpoint
from tests.tests_support import prompt_of
from tests.layers.quant.test_int4_formats import plain_checkpoint

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def llm(path, **kw):
    kw = {"device": "cpu", "max_model_len": 128, "kv_cache_memory": 8 << 20, **kw}
    return LLM(path, show_progress=False, **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-engine")
    src = make_random_checkpoint(str(root / "src"), preset="tiny-g128")
    weights = load_file(os.path.join(src, "model.safetensors"))
    rtn = {name: F.dequantize(*F.quantize_rtn(w, 128, torch.float32), 128)
           if name.endswith("proj.weight") else w for name, w in weights.items()}
    return src, plain_checkpoint(src, str(root / "rtn"), rtn)


def run(engine, prompts, params):
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def assert_same(a, b, what):
    """Same token ids; logprobs of the same tokens, equal up to fp32 summation order."""
    for rows_a, rows_b in zip(a, b, strict=True):
        for (ids_a, lps_a), (ids_b, lps_b) in zip(rows_a, rows_b, strict=True):
            assert ids_a == ids_b, what
            for pa, pb in zip(lps_a, lps_b, strict=True):
                assert pa.keys() == pb.keys(), what
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa), what


def test_sampling_options_prefix_caching_and_n_match_the_float_twin(checkpoints):
    src, twin = checkpoints
    int4, plain = llm(src, quantization="int4"), llm(twin)
    shared = prompt_of(40, salt=1)                    # 2 pages and a half of a shared prefix
    prompts = [shared + prompt_of(3, salt=2), prompt_of(9, salt=3)]
    options = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=11, max_tokens=8, n=2,
                              logprobs=3, ignore_eos=True),
               SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                              seed=5, max_tokens=8, ignore_eos=True, logprobs=1),
               SamplingParams(temperature=0, max_tokens=8, min_tokens=4, ignore_eos=True, logprobs=2)]
    for params in options:
        assert_same(run(int4, prompts, params), run(plain, prompts, params), params)
    # the second pass over the shared prefix is served from the prefix cache, on both
    for engine in (int4, plain):
        before = engine.engine.stats().prompt_tokens
        engine.generate([shared + prompt_of(5, salt=4)], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert engine.engine.stats().prompt_tokens - before < 16
    again = [shared + prompt_of(5, salt=4)]
    assert_same(run(int4, again, options[0]), run(plain, again, options[0]), "after a prefix-cache hit")


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="the kernel path on CPU tensors runs under TRITON_INTERPRET=1")
def test_kernel_path_generates_what_the_reference_path_does(tmp_path, monkeypatch):
    """bf16 activations: the Triton kernels (skinny at decode, the GEMM for the 45-token prefill)
    against the dequantize-then-matmul reference; greedy tokens identical. down_proj's K = 192 is 1.5
    groups of 128: the kernels' short last group in the engine."""
    # one layer of 128 x 192: the interpreter runs every program of every call (seconds a call)
    src = make_random_checkpoint(str(tmp_path / "small"), preset="tiny-g128", hidden_size=128, intermediate_size=192,
                                 num_hidden_layers=1)
    engine = llm(src, quantization="int4", dtype="bfloat16")
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 40))]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kernel = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")          # int4_matmul reads the knob per call: the reference
    reference = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)]
    assert kernel == reference


def test_a_short_last_group_loads_and_matches_the_float_twin(tmp_path):
    """Intermediate size 320 = 2.5 groups of 128 (DeepSeek-V2-Lite's dense 10944 = 85.5): down_proj's
    tables have 3 rows. quantization='int4' gives the RTN twin's logits and tokens; a compressed-tensors
    and a GPTQ act-order checkpoint (AutoGPTQ's and compressed-tensors' ceil(K / G) groups) load their
    reference weights exactly; one whose scales have K // G rows is refused naming the tensor."""
    from tests.layers.quant.test_int4_formats import build, dequantized_layers, merged_reference, quantize_checkpoint, variant
    src = make_random_checkpoint(str(tmp_path / "src"), preset="tiny-g128", intermediate_size=320, num_hidden_layers=1)
    weights = load_file(os.path.join(src, "model.safetensors"))
    rtn = {name: F.dequantize(*F.quantize_rtn(w, 128, torch.float32), 128)
           if name.endswith("proj.weight") else w for name, w in weights.items()}
    int4, twin = llm(src, quantization="int4"), llm(plain_checkpoint(src, str(tmp_path / "rtn"), rtn))
    assert int4.engine.runner.model.model.layers[0].mlp.down_proj.scales.shape == (3, 256)
    prompts, greedy = [prompt_of(9, salt=1), prompt_of(30, salt=2)], SamplingParams(temperature=0, max_tokens=6,
                                                                                     ignore_eos=True, logprobs=2)
    assert_same(run(int4, prompts, greedy), run(twin, prompts, greedy), "int4 at load, K = 320")
    for fmt, opts in (("compressed-tensors", {}), ("gptq", {"desc_act": True})):
        path = str(tmp_path / fmt)
        ref = quantize_checkpoint(src, path, fmt, 128, torch.float16, **opts)
        for name, w in dequantized_layers(build(path)).items():
            assert torch.equal(w, merged_reference(ref, name)), (fmt, name)
    down = "model.layers.0.mlp.down_proj.weight_scale"
    bad = variant(tmp_path, str(tmp_path / "compressed-tensors"), "floor",
                  lambda t: t.update({down: t[down][:, :2].contiguous()}))
    with pytest.raises(ValueError, match=r"weight_scale' has shape \(256, 2\), expected \(256, 3\) .*group size 128; "
                                         r"K = 320: the last of 3 groups holds 64 inputs"):
        build(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_and_overlapped_decode_give_the_eager_tokens(checkpoints):
    src, _ = checkpoints
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 19, 40, 70))]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)]
    outs = {}
    for name, kw in {"eager": dict(enforce_eager=True, async_scheduling=False), "graphs": dict(async_scheduling=False),
                     "overlap": dict(async_scheduling=True)}.items():
        with llm(src, quantization="int4", dtype="bfloat16", device="cuda", **kw) as engine:
            outs[name] = [[o.outputs[0].token_ids for o in engine.generate(prompts, p, use_tqdm=False)] for p in params]
            if name == "overlap":
                assert engine.engine.stats().num_overlapped_steps > 0
    assert outs["graphs"] == outs["eager"] and outs["overlap"] == outs["eager"]
