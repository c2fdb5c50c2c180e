"""Engine acceptance on the GPU, in bfloat16, with a Llama-3-8B-shaped random checkpoint.

bf16 kernels legitimately round differently from transformers, so the check is the usual one:
the first greedy token that differs (if any) must be within the reference's top-5 at that step.
Runs on the torch reference attention (eager) and on ridge's Triton kernels with decode CUDA
graphs on ("triton") and off ("triton-eager"); test 5 checks graphs on and off give identical
outputs.
"""
import os

import pytest
import torch

from ridge import LLM, SamplingParams

pytestmark = pytest.mark.gpu
N_NEW = 32


def prompt_of(length, salt=0, vocab=128256):
    g = torch.Generator().manual_seed(1000 * salt + length)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def big():
    from ridge.utils.random_checkpoint import make_random_checkpoint
    path = os.environ.get("RIDGE_8B_PATH", "/tmp/ridge-llama3-8b")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_random_checkpoint(path, "llama", "llama3-8b", dtype=torch.bfloat16, device="cuda")
    return path


def first_divergence_ok(got, ref, ref_top5):
    """ref_top5[i]: the reference's five best tokens at step i."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert a in ref_top5[i], f"step {i}: token {a} not in reference top-5 {ref_top5[i]}"
            return i
    assert len(got) == len(ref)
    return None


def ridge_with_top5(llm, prompts, params_list):
    outs = llm.generate(prompts, params_list, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(e, key=lambda t: e[t].rank)[:5] for e in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module",
                params=os.environ.get("RIDGE_TEST_BACKENDS", "torch,triton,triton-eager").split(","))
def llm(request, big):
    backend, _, mode = request.param.partition("-")
    with LLM(big, dtype="bfloat16", device="cuda", attention_backend=backend, max_model_len=4096,
             kv_cache_memory=16 << 30, show_progress=False, enforce_eager=mode == "eager") as engine:
        yield engine          # closed when the next backend's engine is built: its memory is given back


def greedy(n=N_NEW, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5, **kw)


def test_1_greedy_matches_transformers_top5(llm, big):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(big, dtype=torch.bfloat16, device_map="cuda").eval()
    prompts = [prompt_of(n, salt=i) for i, n in enumerate((5, 100, 37, 300))]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                        do_sample=False, eos_token_id=None, pad_token_id=2, output_scores=True,
                        return_dict_in_generate=True)
        ref = g.sequences[0, len(p):].tolist()
        top5 = [s[0].topk(5).indices.tolist() for s in g.scores]
        first_divergence_ok(o.outputs[0].token_ids, ref, top5)
    del hf
    torch.cuda.empty_cache()


def test_2_batch_invariance(llm):
    target = prompt_of(13, salt=99)
    (alone, top5), = ridge_with_top5(llm, [target], [greedy()])
    others = [prompt_of(n, salt=i) for i, n in enumerate([5, 600, 1, 33, 8, 1000, 2, 17, 45, 3, 70, 9, 260, 4, 51, 12])]
    outs = llm.generate(others[:8] + [target] + others[8:], greedy(), use_tqdm=False)
    first_divergence_ok(outs[8].outputs[0].token_ids, alone, top5)


def test_3_preemption_chunking_prefix_caching(llm, big):
    prefix = prompt_of(300, salt=777)
    prompts = [(prefix if i % 2 else []) + prompt_of(200 + (i * 37) % 300, salt=i) for i in range(32)]
    params = [greedy(40 + (i * 13) % 40) for i in range(32)]
    ample = ridge_with_top5(llm, prompts, params)
    bm = llm.engine.pages
    assert bm.num_free_pages == bm.num_pages
    with LLM(big, dtype="bfloat16", device="cuda", attention_backend=llm.engine.runner.backend.name,
             max_model_len=4096, kv_cache_memory=80 * llm.engine.runner.kv_bytes_per_page(),
             max_num_batched_tokens=256, show_progress=False, max_num_seqs=16,
             enforce_eager=llm.engine.cfg.enforce_eager) as small:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        for (ref, top5), o in zip(ample, outs):
            first_divergence_ok(o.outputs[0].token_ids, ref, top5)
        sbm = small.engine.pages
        assert sbm.num_free_pages == sbm.num_pages


def race_top5(hf, tokens, params, step):
    """The five tokens with the best exponential-race scores (p_i / E_i, the quantity ridge's
    sampler maximises) under transformers' logits and this request's own noise at `step`:
    the sampled-token analogue of the greedy top-5 check."""
    from ridge.layers.sampler import filter_probs, uniform_noise
    from tests.tests_support import single_row_batch
    with torch.no_grad():
        logits = hf(torch.tensor([tokens], device="cuda")).logits[0, -1].float()[None]
    b = single_row_batch(params, step, logits.shape[-1], logits.device)
    probs = filter_probs(torch.softmax(logits / params.temperature, dim=-1), b)
    score = probs / -torch.log(uniform_noise(b.seeds, b.steps, logits.shape[-1]))
    return score[0].topk(5).indices.tolist()


def test_4_seeded_sampling(llm, big):
    target = prompt_of(11, salt=3)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], p, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([target], p, use_tqdm=False)[0].outputs[0].token_ids == alone
    others = [prompt_of(n, salt=i) for i, n in enumerate([4, 300, 9, 17, 2, 50])]
    rest = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)
    batched = llm.generate(others[:3] + [target] + others[3:], [rest] * 3 + [p] + [rest] * 3,
                           use_tqdm=False)[3].outputs[0].token_ids
    step = next((i for i, (a, b) in enumerate(zip(batched, alone)) if a != b), None)
    if step is not None:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(big, dtype=torch.bfloat16, device_map="cuda").eval()
        top5 = race_top5(hf, target + alone[:step], p, step)
        del hf
        torch.cuda.empty_cache()
        assert batched[step] in top5 and alone[step] in top5, (step, batched[step], alone[step], top5)
    other = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([target], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_5_cuda_graphs_change_nothing(big):
    """Decode replayed from CUDA graphs and run eagerly, each step launched before the previous
    step's ids are read back (async scheduling) or after: token for token the same outputs
    (greedy and seeded sampling, ragged batch, sizes that fall between graph buckets)."""
    prompts = [prompt_of(n, salt=50 + i) for i, n in enumerate([3, 120, 17, 400, 1, 64, 9, 250, 33, 5, 77])]
    params = [greedy(20 + i) if i % 2 else
              SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=i, max_tokens=25, ignore_eos=True)
              for i in range(len(prompts))]
    results = []
    for eager, overlap in ((False, True), (True, True), (False, False)):
        with LLM(big, dtype="bfloat16", device="cuda", attention_backend="triton", max_model_len=2048,
                 kv_cache_memory=4 << 30, max_num_seqs=32, show_progress=False, enforce_eager=eager,
                 async_scheduling=overlap) as engine:
            assert (engine.engine.runner.decode_graphs.graphs != {}) == (not eager)
            results.append([o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
            assert (engine.engine.stats().num_overlapped_steps > 0) == overlap
    assert results[0] == results[1] == results[2]
