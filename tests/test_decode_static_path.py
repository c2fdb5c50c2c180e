"""The padded static-buffer decode path (what CUDA graphs replay), run eagerly on the CPU through
the Triton interpreter: bucket padding, empty rows and slot -1 must change no output."""
import pytest

from ridge import LLM, SamplingParams
from ridge.runner.cuda_graphs import batch_buckets


def test_batch_buckets():
    assert batch_buckets(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.slow
def test_static_decode_path_matches_reference(checkpoints):
    path = checkpoints("llama")
    prompts = [[5, 9, 13], [7] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 33, [8, 8]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True)] * 2 + \
             [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cpu", show_progress=False, max_model_len=128, max_num_seqs=6,
                  attention_backend=backend)
        assert (llm.engine.runner.decode_graphs is not None) == (backend == "triton")
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["triton"] == runs["torch"]
