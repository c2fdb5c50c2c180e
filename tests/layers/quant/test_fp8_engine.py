"""FP8 in the engine: `--kv-cache-dtype fp8` (and `--kv-cache-hadamard`) and `--quantization fp8`,
end to end on the CPU. The Triton kernels (under the interpreter) and the torch reference agree on
greedy outputs over an FP8 cache; the pool holds twice the pages; FP8 weights run the block-scaled
arithmetic and stay close to the float model; the norms and SiLU-and-mul hand FP8 kernels their
input quantized, and bf16 batches bf16, with the unfused run's tokens; bad settings are rejected by
name."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ridge import LLM, SamplingParams
from ridge.config import EngineConfig
from ridge.kernels.fp8_gemm import fp8_gemm_ref, quantize_act_fp8_ref
from ridge.layers.linear import Linear
from ridge.layers import activation, norm
from ridge.layers.quant.fp8 import dispatch as fp8_dispatch
from ridge.layers.quant.fp8 import linear as fp8_linear
from ridge.layers.quant.fp8.dispatch import BUCKETS, bucket_of
from ridge.layers.quant.fp8.formats import dequantize_fp8_block

PROMPTS = [[5, 9, 13], [7] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 11] * 4, [8, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_fp8_kv_greedy_equals_the_reference_path(checkpoints, hadamard):
    """Chunked prefill (8-token budget: cached prefixes read back from FP8 pages), decode through
    the static path, prefix-cache hits: the Triton kernels give the torch reference's tokens. One
    decoder layer: each token is interpreted kernel programs in every layer, and the FP8 pages are
    written and read the same way in each. Three of PROMPTS: without the 20-token one, the 36-token
    one's chunks still read back full FP8 pages and the static-path steps are the same (bucket 2, 1)."""
    path = checkpoints("llama-1layer")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cpu", show_progress=False, max_model_len=96, max_num_seqs=4, attention_backend=backend,
                  kv_cache_dtype="fp8", kv_cache_hadamard=hadamard, max_num_batched_tokens=8)
        assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        runs[backend] = greedy(llm, prompts) + greedy(llm, PROMPTS[2:3])  # the second call hits the prefix cache
    assert runs["triton"] == runs["torch"]


def test_fp8_pool_holds_twice_the_pages(checkpoints):
    path = checkpoints("llama")
    pages = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, device="cpu", dtype="bfloat16", show_progress=False, max_model_len=64, kv_cache_memory=2**22,
                  kv_cache_dtype=kv)
        pages[kv] = llm.engine.runner.kv_bytes_per_page(), llm.engine.cfg.num_pages
        d = llm.engine.runner.model_cfg.head_dim
    assert pages["fp8"][0] * 2 * d == pages["auto"][0] * (d + 1)          # head_dim + 1 bytes a row, vs 2 x head_dim
    assert pages["fp8"][1] >= 2 * pages["auto"][1] * d / (d + 1) - 1


def test_fp8_weights_run_the_block_scaled_arithmetic(checkpoints):
    path = checkpoints("llama")
    fp8 = LLM(path, device="cpu", show_progress=False, max_model_len=64, quantization="fp8")
    ref = LLM(path, device="cpu", show_progress=False, max_model_len=64)
    layer = fp8.engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Linear) and layer.weight is None                  # the float weight is freed
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.quant_method.path(5) == "reference"
    x = torch.randn(5, layer.in_features)
    want = fp8_gemm_ref(*quantize_act_fp8_ref(layer.input_act(x)), layer.weight_fp8, layer.weight_scale_inv,
                        torch.float32)
    torch.testing.assert_close(layer(x), want)
    w = ref.engine.runner.model.model.layers[0].mlp.down_proj.weight
    deq = dequantize_fp8_block(layer.weight_fp8, layer.weight_scale_inv, (128, 128))
    assert ((deq - w).abs() <= w.abs().amax() * 2**-4).all()                  # within e4m3's step of each block
    ids = torch.tensor(PROMPTS[2])
    lp = [llm.engine.runner.model.compute_logits(llm.engine.runner.model(
        ids, torch.arange(len(ids)), llm.engine.runner.layer_caches,
        llm.engine.runner.metadata(list(range(len(ids))), [0, len(ids)], [len(ids)], [[0, 1, 2]])))[-1].log_softmax(-1)
        for llm in (fp8, ref)]
    kl = torch.sum(lp[1].exp() * (lp[1] - lp[0])).item()
    assert 0 < kl < 1e-2


def dispatch_by_hand(llm, fp8_from: int, path: str = "triton:ptr64x128") -> int:
    """What a GPU's measured table could say (a CPU measures none): bf16 below `fp8_from` rows, ridge's
    FP8 kernel from there (run by the interpreter); the bf16 batches read the dequantized FP8
    weight. Returns the number of FP8 layers."""
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quant_method is not None]
    for m in layers:
        m.quant_method.paths = {b: "bf16" if b < fp8_from else path for b in BUCKETS}
        m.weight = torch.nn.Parameter(dequantize_fp8_block(m.weight_fp8, m.weight_scale_inv, (128, 128),
                                                           m.quant_method.float_dtype), requires_grad=False)
    return len(layers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter")
def test_fused_fp8_producers_give_the_unfused_tokens(checkpoints, monkeypatch):
    """Prefill batches (61 and 5 rows) run the FP8 kernel, decode batches (4 and 1 rows) bf16. Fused:
    each FP8 forward runs the two norms and SiLU-and-mul quantizing (no bf16 batch does), and the
    separate quantization pass runs only for o_proj (whose producer is attention); unfused (the
    layers answer takes_quantized_input with no): four passes a layer. Greedy tokens are the same.
    One decoder layer: its input norm has no residual, its second norm has one (both of the norm's
    fused forms), and every kernel program is interpreted."""
    llm = LLM(checkpoints("llama-1layer"), device="cpu", dtype="bfloat16", show_progress=False, max_model_len=64,
              quantization="fp8", enable_prefix_caching=False)      # both runs prefill every prompt token
    assert dispatch_by_hand(llm, fp8_from=5) == 4 * llm.engine.runner.model_cfg.num_layers
    rows = {"norm": [], "silu": [], "separate": [], "bf16": 0}

    def spy(module, name, key):
        real = getattr(module, name)

        def call(x, *args, **kw):
            rows[key].append(x.shape[0])
            return real(x, *args, **kw)
        monkeypatch.setattr(module, name, call)
    spy(norm, "rms_norm_fp8", "norm"), spy(activation, "silu_and_mul_fp8", "silu")
    spy(fp8_dispatch, "quantize_act_fp8", "separate")
    real_bf16 = fp8_linear.bf16_matmul
    monkeypatch.setattr(fp8_linear, "bf16_matmul", lambda x, w: rows.__setitem__("bf16", rows["bf16"] + 1) or
                        real_bf16(x, w))
    tokens, counts = {}, {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(Linear, "takes_quantized_input", lambda self, n: False)
            for v in rows.values():
                v.clear() if isinstance(v, list) else None
            rows["bf16"] = 0
            tokens[fused] = greedy(llm) + greedy(llm, [PROMPTS[1][:5]])
            counts[fused] = {k: (sorted(set(v)), len(v)) if isinstance(v, list) else v for k, v in rows.items()}
    assert tokens[True] == tokens[False]
    layers = llm.engine.runner.model_cfg.num_layers
    fused, unfused = counts[True], counts[False]
    assert fused["norm"] == ([5, 61], 2 * 2 * layers) and fused["silu"] == ([5, 61], 2 * layers)
    assert fused["separate"] == ([5, 61], 2 * layers)
    assert unfused["norm"] == unfused["silu"] == ([], 0) and unfused["separate"] == ([5, 61], 2 * 4 * layers)
    assert fused["bf16"] == unfused["bf16"] > 0


def test_dispatch_buckets():
    assert [bucket_of(m) for m in (1, 2, 5, 8, 9, 4096, 4097, 10**6)] == [1, 4, 8, 8, 16, 4096, 8192, 8192]
    assert list(BUCKETS) == sorted(BUCKETS)


def test_a_model_too_big_for_bf16_copies_dispatches_fp8_only(monkeypatch):
    """Where bf16 measured faster a layer keeps its bf16 weight; a model whose float weights exceed
    half the GPU (70B on one H200) may not, and takes the fastest FP8 path of every bucket."""
    from types import SimpleNamespace
    from ridge.layers.quant.fp8.config import keeps_float_copies
    table = {"1": {"choice": "bf16", "us": {"bf16": 5.0, "cublas": 9.0, "triton:ptr64x128": 7.0}, "errors": {}},
             "64": {"choice": "cublas", "us": {"bf16": 8.0, "cublas": 6.0}, "errors": {}}}
    monkeypatch.setattr(fp8_dispatch, "measured", lambda path, version, buckets, measure: table)
    w = torch.empty(4, 4)
    assert fp8_dispatch.dispatch_table(w, w, w) == {1: "bf16", 64: "cublas"}
    assert fp8_dispatch.dispatch_table(w, w, w, allow_bf16=False) == {1: "triton:ptr64x128", 64: "cublas"}
    table["64"]["us"] = {"bf16": 8.0}
    with pytest.raises(RuntimeError, match="no FP8 GEMM ran for 4x4 at batch 64"):
        fp8_dispatch.dispatch_table(w, w, w, allow_bf16=False)
    assert keeps_float_copies(10**15, torch.device("cpu"))            # the CPU reference keeps no copy anyway
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=141e9))
    assert keeps_float_copies(16e9, torch.device("cuda"))             # an 8B model's bf16 weights
    assert not keeps_float_copies(141e9, torch.device("cuda"))        # a 70B model's


def test_bad_fp8_settings_are_named():
    with pytest.raises(ValueError, match="kv_cache_hadamard: .*needs kv_cache_dtype='fp8'"):
        EngineConfig(kv_cache_hadamard=True)
    with pytest.raises(ValueError, match="kv_cache_dtype.*fp8_e5m2"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dispatch_table_times_every_path(tmp_path, monkeypatch):
    """On a GPU the table has a timed choice per bucket, cuBLAS and bf16 among the candidates, and
    the path it picks computes the block-scaled product."""
    from ridge.layers.quant.fp8.dispatch import fp8_matmul, measure_shape
    from ridge.layers.quant.fp8.formats import quantize_fp8_block
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    w = (torch.randn(1024, 2048, device="cuda") * 0.02).bfloat16()
    wq, ws = quantize_fp8_block(w)
    table = measure_shape(w, wq, ws)
    assert set(table) == {str(m) for m in BUCKETS}
    for m, e in table.items():
        assert e["choice"] in e["us"] and "bf16" in e["us"], (m, e)
        x = torch.randn(int(m), 2048, device="cuda").bfloat16()
        for path in e["us"]:
            if path != "bf16":
                got = fp8_matmul(path, x, wq, ws).float()
                want = fp8_gemm_ref(*quantize_act_fp8_ref(x), wq, ws, torch.float32)
                assert (got - want).abs().max() <= 2e-2 * want.abs().max(), (m, path)


def test_cost_follows_the_dispatch():
    """The roofline reads a layer's bytes from the path its dispatch runs for the step's rows: FP8
    blocks where an FP8 GEMM runs, the float weight where the measured table picked bf16."""
    from ridge.layers.cost import StepShape
    from ridge.layers.quant.fp8.config import Fp8Config
    layer = Linear(256, 128, quant=Fp8Config())
    layer.weight.data.normal_(0, 0.02)
    layer.quant_method.finish_loading(layer)
    layer.quant_method.paths = {b: "bf16" if b <= 4 else "cublas" for b in BUCKETS}
    small, large = (StepShape((1,) * m, (9,) * m, dtype=torch.float32) for m in (1, 64))
    assert layer.weight_precision(small).bytes == 4 and layer.weight_precision(large).name == "fp8-block128"
    assert layer.cost(large)[-1].param_bytes == 128 * 256 * (1 + 4 / 128 ** 2)


def test_cost_of_the_fused_producers(checkpoints, monkeypatch):
    """Where the dispatch runs an FP8 kernel, the norms before QKV / gate-up and SiLU-and-mul write
    FP8_ACT and only o_proj states a quantization pass: against every layer quantizing its own input,
    each of the three activations a layer saves its bf16 write and read (2 x 2 bytes an element);
    the FLOPs are the same. Where the dispatch runs bf16, nothing quantizes."""
    from ridge.layers.cost import FP8_ACT, StepShape
    llm = LLM(checkpoints("llama"), device="cpu", dtype="bfloat16", show_progress=False, max_model_len=64,
              quantization="fp8")
    dispatch_by_hand(llm, fp8_from=5)
    model, cfg = llm.engine.runner.model, llm.engine.runner.model_cfg
    prefill, decode = StepShape((40, 21), (40, 21)), StepShape((1,) * 4, (9,) * 4)
    fused = {s: model.cost(s) for s in (prefill, decode)}
    with monkeypatch.context() as m:
        m.setattr(Linear, "takes_quantized_input", lambda self, n: False)
        unfused = {s: model.cost(s) for s in (prefill, decode)}
    quant = [c for c in fused[prefill] if c.name == "act_quant"]
    assert [c.module for c in quant] == [f"model.layers.{i}.self_attn.o_proj" for i in range(cfg.num_layers)]
    assert sum(c.name == "act_quant" for c in unfused[prefill]) == 4 * cfg.num_layers
    norm = next(c for c in fused[prefill] if c.module == "model.layers.1.input_layernorm")
    n = 61 * cfg.hidden_size
    assert norm.bytes == n * (3 * 2 + FP8_ACT.bytes) + 2 * cfg.hidden_size      # x, residual, residual out; weight
    qkv = next(c for c in fused[prefill] if c.name == "qkv_proj")
    out = model.model.layers[0].self_attn.qkv_proj.out_features
    assert qkv.bytes - qkv.param_bytes == n * FP8_ACT.bytes + 61 * out * 2         # reads FP8, writes bf16
    saved = sum(c.bytes for c in unfused[prefill]) - sum(c.bytes for c in fused[prefill])
    assert saved == 61 * 2 * 2 * (2 * cfg.hidden_size + cfg.intermediate_size) * cfg.num_layers
    assert sum(c.flops for c in unfused[prefill]) == sum(c.flops for c in fused[prefill])
    assert [(c.name, c.bytes) for c in fused[decode]] == [(c.name, c.bytes) for c in unfused[decode]]
    assert not any(c.name == "act_quant" for c in fused[decode])
