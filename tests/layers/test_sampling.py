"""Acceptance: seeded sampling reproducible alone or in a batch; the sampler's pieces."""
import torch

from ridge import SamplingParams
from ridge.layers.sampler import SamplingBatch, apply_penalties, filter_probs, sample, uniform_noise
from tests.tests_support import prompt_of


def test_seeded_sampling_is_batch_invariant_and_seed_dependent(tiny_llm):
    target = prompt_of(11, salt=3)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate([target], p, use_tqdm=False)[0].outputs[0]
    others = [prompt_of(n, salt=i) for i, n in enumerate([4, 30, 9, 17, 2, 50])]
    batch_params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True) for _ in others]
    outs = tiny_llm.generate(others[:3] + [target] + others[3:], batch_params[:3] + [p] + batch_params[3:],
                             use_tqdm=False)
    assert outs[3].outputs[0].token_ids == alone.token_ids
    assert outs[3].outputs[0].text == alone.text
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=24, ignore_eos=True)
    assert tiny_llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone.token_ids


def test_n_samples_share_the_prompt_and_differ(tiny_llm):
    bm = tiny_llm.engine.pages
    prompt = prompt_of(21, salt=8)            # 21 tokens: the last page is partial and shared
    out = tiny_llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0]
    samples = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(s) == 16 for s in samples)
    assert len({tuple(s) for s in samples}) == 3
    again = tiny_llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == samples
    greedy = tiny_llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert bm.num_free_pages == bm.num_pages


def test_fork_shares_pages_then_copies_on_write(tiny_llm):
    eng = tiny_llm.engine
    bm = eng.pages
    eng.add_request(prompt_of(21, salt=8), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8))
    eng.step()                                   # prefill + fork
    parent, child = eng.requests[next(iter(eng.requests))].seqs
    assert parent.page_table == child.page_table
    assert all(bm.ref_counts[b] == 2 for b in parent.page_table)
    eng.step()                                   # both write into the shared partial page -> one copy
    assert parent.page_table[0] == child.page_table[0]      # full page stays shared
    assert parent.page_table[1] != child.page_table[1]      # partial page was copied
    for rid in list(eng.requests):
        eng.abort(rid)
    assert bm.num_free_pages == bm.num_pages


def _batch(n, vocab, **kw):
    base = dict(temperature=torch.ones(n), top_k=torch.full((n,), vocab), top_p=torch.ones(n), min_p=torch.zeros(n),
                seeds=torch.arange(n, dtype=torch.int64) * 7919 + 1, steps=torch.zeros(n, dtype=torch.int64),
                presence_penalty=torch.zeros(n), frequency_penalty=torch.zeros(n), repetition_penalty=torch.ones(n),
                output_counts=None, seen_mask=None, banned=None, max_logprobs=-1)
    base.update(kw)
    return SamplingBatch(**base)


def test_uniform_noise_is_uniform_and_deterministic():
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    steps = torch.tensor([0, 0, 5], dtype=torch.int64)
    u = uniform_noise(seeds, steps, 50_000)
    assert torch.equal(u, uniform_noise(seeds, steps, 50_000))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1])


def test_exponential_race_matches_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20000
    logits = probs.log().expand(n, 4).clone()
    tokens, _ = sample(logits, _batch(n, 4))
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_filters_top_k_top_p_min_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    b = _batch(3, 4, top_k=torch.tensor([2, 4, 4]), top_p=torch.tensor([1.0, 0.65, 1.0]),
               min_p=torch.tensor([0.0, 0.0, 0.6]))
    kept = filter_probs(probs, b) > 0
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]


def test_top_p_one_keeps_the_far_tail():
    """top_p = 1 is off: a token of probability 1e-9 stays although the float32 mass before it
    rounds to 1."""
    probs = torch.tensor([[1.0 - 3e-9, 1e-9, 1e-9, 1e-9]])
    assert (filter_probs(probs, _batch(1, 4)) > 0).all()
    assert (filter_probs(probs, _batch(1, 4, top_p=torch.tensor([0.999]))) > 0).tolist() == [[True, False, False, False]]


def test_penalties_follow_transformers_and_openai():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    seen_ids = torch.tensor([[0, 1]])
    ref = RepetitionPenaltyLogitsProcessor(1.5)(seen_ids, logits.clone())
    b = _batch(1, 4, repetition_penalty=torch.tensor([1.5]), seen_mask=torch.tensor([[True, True, False, False]]))
    assert torch.allclose(apply_penalties(logits, b), ref)
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    b = _batch(1, 4, presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]), output_counts=counts)
    assert torch.allclose(apply_penalties(logits, b), torch.tensor([[1.0, -2.0, 1.25, 0.5]]))


def test_stop_strings_stop_tokens_min_tokens_and_logprobs(tiny_llm):
    prompt = prompt_of(9, salt=4)
    free = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    toks, text = free.outputs[0].token_ids, free.outputs[0].text
    # stop token id: generation ends at (and includes) its first occurrence
    stop_tok = toks[5]
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok],
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[:toks.index(stop_tok) + 1] and out.finish_reason == "stop"
    # stop string: text ends right before it, and it is not in the output
    if len(text) > 6:
        stop = text[4:6]
        out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]
    # min_tokens bans the stop token until then
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=8,
                                                     stop_token_ids=[toks[0]], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8 and toks[0] not in out.token_ids[:8]
    # logprobs: top-k plus the sampled token, ranks from 1, the greedy token ranked first
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 3
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
        assert all(e.logprob <= 0 for e in entry.values())


def test_a_top_p_below_float32s_least_still_keeps_the_first_token():
    """top_p = 5e-324 is valid (> 0) and reads as 0 in float32: the nucleus is the top token alone,
    never empty (an empty one drew token 0, outside a grammar: the server's schema fuzzing)."""
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    top_p = torch.tensor([5e-324], dtype=torch.float64).float()
    assert top_p.item() == 0.0
    assert (filter_probs(probs, _batch(1, 3, top_p=top_p)) > 0).tolist() == [[False, True, False]]
