"""Quantized weights under tensor parallelism (CPU, two processes over gloo): each INT4 format's
packed words and groups, and FP8 quantized at load, cut per rank as the float weight is; TP = 2
gives TP = 1's tokens where every rank's share holds whole groups and blocks, and a split that
would cut one is a clear error."""
import pytest

from ridge import LLM, SamplingParams
from ridge.utils.random_checkpoint import make_random_checkpoint
from tests.tests_support import prompt_of
from tests.layers.quant.test_int4_formats import VARIANTS, quantize_checkpoint


KW = dict(device="cpu", show_progress=False, max_model_len=128)
PROMPTS = [prompt_of(n, salt=i) for i, n in enumerate((4, 19, 33))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def tp2_tokens(path, **kw) -> list[list[int]]:
    with LLM(path, tensor_parallel_size=2, **KW, **kw) as llm:
        return tokens(llm)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """tiny-g128 (256 wide, 4 heads of 64): every rank's share of a projection's inputs is 128 or
    256, whole groups of 64 or 128; 4 KV heads, so each rank's K and V rows are 128, whole FP8 blocks."""
    root = tmp_path_factory.mktemp("tpq")
    return {a: make_random_checkpoint(str(root / a), arch=a, preset="tiny-g128", num_key_value_heads=4)
            for a in ("llama", "qwen2")}


@pytest.mark.parametrize("name", ["awq", "gptq-v2", "ct", "ct-sym-qwen2"])
def test_int4_checkpoints_match_one_rank(sources, tmp_path, name):
    arch, fmt, group, scale_dtype, opts = VARIANTS[name]
    path = str(tmp_path / name)
    quantize_checkpoint(sources[arch], path, fmt, group, scale_dtype, **opts)
    assert tp2_tokens(path) == tokens(LLM(path, **KW))


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_quantized_at_load_matches_one_rank(sources, quantization):
    path = sources["llama"]
    assert tp2_tokens(path, quantization=quantization) == tokens(LLM(path, quantization=quantization, **KW))


def test_splits_that_cut_a_group_are_refused(sources, tmp_path):
    arch, fmt, group, scale_dtype, opts = VARIANTS["gptq-act-order"]
    path = str(tmp_path / "act-order")
    quantize_checkpoint(sources[arch], path, fmt, group, scale_dtype, **opts)
    with pytest.raises(ValueError, match=r"act-order \(desc_act\) groups cannot be split across 2 tensor-parallel"):
        LLM(path, tensor_parallel_size=2, **KW)
    cut = str(tmp_path / "ct-g256")                       # o_proj's 256 inputs: 128 a rank, half a group
    quantize_checkpoint(sources["llama"], cut, "compressed-tensors", 256, scale_dtype)
    with pytest.raises(ValueError, match=r"group_size: 256 does not divide the layer's 128 inputs \(its share on each "
                                         r"of 2 tensor-parallel ranks\)"):
        LLM(cut, tensor_parallel_size=2, **KW)
