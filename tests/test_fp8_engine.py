"""FP8 in the engine: `--kv-cache-dtype fp8` (and `--kv-cache-hadamard`) and `--quantization fp8`,
end to end on the CPU. The Triton kernels (under the interpreter) and the torch reference agree on
greedy outputs over an FP8 cache; the pool holds twice the pages; FP8 weights run the block-scaled
arithmetic and stay close to the float model; bad settings are rejected by name."""
import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.config import EngineConfig
from ridge.kernels.fp8_gemm import fp8_gemm_ref, quantize_act_fp8_ref
from ridge.layers.linear import Linear
from ridge.layers.quant.fp8 import dequantize_fp8_block
from ridge.layers.quant.fp8_dispatch import BUCKETS, bucket_of

PROMPTS = [[5, 9, 13], [7] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 11] * 4, [8, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_fp8_kv_greedy_equals_the_reference_path(checkpoints, hadamard):
    """Chunked prefill (8-token budget: cached prefixes read back from FP8 pages), decode through
    the static path, prefix-cache hits: the Triton kernels give the torch reference's tokens."""
    path = checkpoints("llama")
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cpu", show_progress=False, max_model_len=96, max_num_seqs=4, attention_backend=backend,
                  kv_cache_dtype="fp8", kv_cache_hadamard=hadamard, max_num_batched_tokens=8)
        assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        runs[backend] = greedy(llm) + greedy(llm, PROMPTS[2:3])           # the second call hits the prefix cache
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


def test_dispatch_buckets():
    assert [bucket_of(m) for m in (1, 2, 5, 8, 9, 4096, 4097, 10**6)] == [1, 4, 8, 8, 16, 4096, 8192, 8192]
    assert list(BUCKETS) == sorted(BUCKETS)


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
    from ridge.layers.quant.fp8 import quantize_fp8_block
    from ridge.layers.quant.fp8_dispatch import fp8_matmul, measure_shape
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
    from ridge.layers.quant.fp8_linear import Fp8Config
    layer = Linear(256, 128, quant=Fp8Config())
    layer.weight.data.normal_(0, 0.02)
    layer.quant_method.finish_loading(layer)
    layer.quant_method.paths = {b: "bf16" if b <= 4 else "cublas" for b in BUCKETS}
    small, large = (StepShape((1,) * m, (9,) * m, dtype=torch.float32) for m in (1, 64))
    assert layer.weight_precision(small).bytes == 4 and layer.weight_precision(large).name == "fp8-block128"
    assert layer.cost(large)[-1].param_bytes == 128 * 256 * (1 + 4 / 128 ** 2)
