"""MLA on a GPU: the absorbed decode and expanded prefill kernels at the DeepSeek shapes against the
expanding reference, and a random DeepSeek-V3 checkpoint's decode against transformers, eager and
with the Triton backend's CUDA graphs."""
import dataclasses

import pytest
import torch

from ridge.kernels.mla_attention import (MLADecodeTiles, absorb_query, mla_attention_ref, mla_decode_attention,
                                         unabsorb_output)
from tests.kernels.test_mla_kernels import _decode_batch

pytestmark = pytest.mark.gpu


def _on_cuda(meta):
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


@pytest.mark.parametrize("form", ["engine", "heads-major", "keys-major"])
@pytest.mark.parametrize("H", [16, 128])
def test_absorbed_decode_at_model_shapes(H, form):
    """Each kernel form at both head counts, and the tiles the engine picks for this batch."""
    q, cache, kv_b, meta = _decode_batch([1, 300, 4100, 2000], H, 512, 64, 128, 128, torch.bfloat16)
    q, cache, kv_b = q.cuda(), cache.cuda(), kv_b.cuda()
    meta = _on_cuda(meta)
    ref = mla_attention_ref(q, cache, kv_b, meta, 192 ** -0.5, 128, 128).float()
    q_nope, q_pe = q.split([128, 64], dim=-1)
    tiles = {"engine": None, "heads-major": MLADecodeTiles(min(H, 64), 32, 4 if H < 64 else 8, 2),
             "keys-major": MLADecodeTiles(min(H, 32), 64, 4, 2, True)}[form]
    out = unabsorb_output(mla_decode_attention(absorb_query(q_nope, kv_b), q_pe, cache, meta, 192 ** -0.5,
                                               tiles=tiles), kv_b, 128).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("H", [16, 128])
def test_expanded_prefill_at_model_shapes(H):
    """Whole prompts, chunks over cached prefixes and decode rows, against the expanding reference."""
    from ridge.kernels.mla_prefill import mla_prefill_attention
    q, cache, kv_b, meta = _decode_batch([700, 1500, 90, 2049], H, 512, 64, 128, 128, torch.bfloat16,
                                         q_lens=[700, 333, 1, 1024])
    q, cache, kv_b, meta = q.cuda(), cache.cuda(), kv_b.cuda(), _on_cuda(meta)
    ref = mla_attention_ref(q, cache, kv_b, meta, 192 ** -0.5, 128, 128).float()
    out = mla_prefill_attention(q, cache, kv_b, meta, 192 ** -0.5, 128, 128).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deepseek_engine_on_cuda_matches_transformers(checkpoints, backend):
    from transformers import AutoModelForCausalLM

    from ridge import LLM, SamplingParams
    from tests.tests_support import prompt_of
    path = checkpoints("deepseekv3")
    llm = LLM(path, device="cuda", dtype="float32", show_progress=False, max_model_len=256, attention_backend=backend)
    assert (llm.engine.runner.decode_graphs is not None) == (backend == "triton")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 30, 12))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, eos_token_id=None, pad_token_id=2)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want
