"""Speculative decoding in the engine (ridge/engine/spec/): greedy identity with every proposer,
the sampled distribution, seeds, sampling parameters, stops and limits in the middle of an accepted
run, pages. Adaptation and metrics: test_spec_adaptation.py."""
import math
import os

import pytest
import torch
from tests.spec.spec_support import (DEMO, DRAFT, GREEDY, NGRAM, PROMPTS, SUFFIX, always_draft, config_of, draft_model, llm,
                                     repetitive, tokens)
from tests.tests_support import prompt_of

from ridge import LLM, SamplingParams


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
@pytest.mark.parametrize("target", ["demo", "random"])
def test_greedy_is_plain_decoding_alone_and_batched(proposer, target, pair, demo_plain):
    model, draft = (DEMO, DRAFT) if target == "demo" else pair
    plain = demo_plain if target == "demo" else llm(model)
    spec = llm(model, speculative_config=config_of(proposer, draft))
    want = tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    batched = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(batched) == want
    assert [spec.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS] == want
    assert sum(o.metrics.num_drafts for o in batched) > 0
    if target == "demo" or proposer != "draft":      # the demo pair agrees often; prompts repeat
        assert sum(o.metrics.num_accepted_tokens for o in batched) > 0
    assert spec.engine.pages.num_free_pages == spec.engine.cfg.num_pages


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft"])
def test_greedy_identity_across_preemption_chunked_prefill_and_prefix_hits(proposer, demo_plain):
    shared = repetitive(9, 48)
    prompts = [shared + prompt_of(5, i) for i in range(6)]
    want = tokens(demo_plain.generate(prompts, GREEDY, use_tqdm=False))
    spec = llm(DEMO, speculative_config=config_of(proposer, DRAFT),
               enable_prefix_caching=True, max_num_batched_tokens=32, page_size=8,
               kv_cache_memory=24 * 2 * 6 * 8 * 2 * 64 * 4)   # 24 target pages (fewer with a draft): preempts
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == want
    assert spec.engine.stats().num_preemptions > 0
    assert spec.engine.stats().prompt_tokens < sum(map(len, prompts))      # the shared prefix was hit
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    spec.engine.speculator.plan([])                 # nothing runs: every sequence's draft state goes
    if proposer == "draft":
        draft = spec.engine.speculator.proposer
        assert not draft.states and draft.pages.num_free_pages == draft.pages.num_pages
    if proposer == "suffix":                        # finished outputs are cached, no sequence is held
        suffix = spec.engine.speculator.proposer
        assert not suffix.corpora and not suffix.seqs and len(suffix.cached) == len(prompts)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels run on a CPU only under TRITON_INTERPRET=1")
@pytest.mark.slow
def test_verify_steps_replay_the_padded_static_path(checkpoints):
    """With the Triton backend, verify steps run on the verify graphs' static buffers (the
    interpreter on a CPU), every sequence padded to k + 1 tokens: still plain decoding's tokens.
    One layer, three short prompts (bucket 4, a padding row): two whose continuations repeat (drafts
    accepted, k long and shorter; the first passes 32 keys, so two splits merge), one without drafts
    at first (its rows padding but the first)."""
    target = checkpoints("llama-1layer")
    prompts = [repetitive(3, 28), repetitive(1, 14), prompt_of(3, 3)]
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = tokens(llm(target).generate(prompts, short, use_tqdm=False))
    spec = llm(target, attention_backend="triton",
               speculative_config={**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    graphs, used = spec.engine.runner.verify_graphs, []
    run = graphs.run
    graphs.run = lambda step, *a: used.append(len(step.seq_lens)) or run(step, *a)
    outs = spec.generate(prompts, short, use_tqdm=False)
    assert tokens(outs) == want and used and graphs.queries == 4
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def _two_sample_chi2(a: list[int], b: list[int]) -> tuple[float, int]:
    bins = set(a) | set(b)
    ca, cb = (torch.bincount(torch.tensor(x), minlength=max(bins) + 1).float() for x in (a, b))
    keep = (ca + cb) > 0
    stat = (((ca - cb) ** 2)[keep] / (ca + cb)[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def _chi2_quantile(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square upper quantile at the normal z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _second_tokens(engine_llm, n: int, prompt=None) -> list[int]:
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True) for s in range(n)]
    prompt = prompt_of(6, 1) if prompt is None else prompt
    return [o.outputs[0].token_ids[2] for o in engine_llm.generate([prompt] * n, params, use_tqdm=False)]


def test_sampled_distribution_is_the_targets_and_a_wrong_rule_is_caught(pair, monkeypatch):
    """A tiny random target with a different random draft: the third token (drawn after two
    verify-able positions) has the same distribution with and without speculation, by a
    two-sample chi-square test that accepting every draft fails."""
    target, draft = pair
    n = 600
    plain = _second_tokens(llm(target), n)
    spec_llm = llm(target, speculative_config=draft_model(draft, k=2))
    spec = _second_tokens(spec_llm, n)
    assert spec_llm.engine.stats().spec_num_draft_tokens > 0
    stat, df = _two_sample_chi2(plain, spec)
    assert stat < _chi2_quantile(df), (stat, df)

    import ridge.engine.spec.speculator as sp
    accept_everything = lambda drafts, q, p, seeds, steps, greedy, num_draft: _accept_all(drafts, p, num_draft)  # noqa: E731

    monkeypatch.setattr(sp, "verify", accept_everything)
    wrong = _second_tokens(llm(target, speculative_config=draft_model(draft, k=2)), n)
    stat, df = _two_sample_chi2(plain, wrong)
    assert stat > _chi2_quantile(df), (stat, df)


def test_suffix_drafts_keep_the_sampled_distribution(pair, monkeypatch):
    """Suffix decoding's point-mass drafts: a prompt of 240 distinct tokens (of the vocabulary's
    509), so a sampled token is often in it and what followed it there is drafted (a seeded request
    drafts from its own tokens only). The third token's distribution with and without drafts agrees
    by the same chi-square test, which accepting every draft fails."""
    target, _ = pair
    n, prompt = 600, (torch.randperm(509, generator=torch.Generator().manual_seed(4))[:240] + 3).tolist()
    plain = _second_tokens(llm(target), n, prompt)
    spec_llm = llm(target, speculative_config={**SUFFIX, "num_speculative_tokens": 2})
    spec = _second_tokens(spec_llm, n, prompt)
    assert spec_llm.engine.stats().spec_num_draft_tokens > 0
    stat, df = _two_sample_chi2(plain, spec)
    assert stat < _chi2_quantile(df), (stat, df)

    import ridge.engine.spec.speculator as sp
    monkeypatch.setattr(sp, "verify", lambda drafts, q, p, seeds, steps, greedy, num_draft: _accept_all(drafts, p, num_draft))
    wrong = _second_tokens(llm(target, speculative_config={**SUFFIX, "num_speculative_tokens": 2}), n, prompt)
    stat, df = _two_sample_chi2(plain, wrong)
    assert stat > _chi2_quantile(df), (stat, df)


def _accept_all(drafts, p, num_draft):
    """The wrong rule: keep every draft, then the target's argmax."""
    n, k = drafts.shape
    out = torch.cat([drafts, torch.full((n, 1), -1, dtype=torch.long)], dim=1)
    rows = torch.arange(n)
    out[rows, num_draft] = p[rows, num_draft].argmax(-1)
    return out, num_draft + 1


def test_seeds_mixed_batches_and_separate_streams():
    """A seeded request gives the same tokens alone and in a batch with unseeded, greedy and
    speculating neighbours; unseeded requests do not share one stream."""
    spec = llm(DEMO, speculative_config=draft_model(DRAFT))
    seeded = SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    prompt = repetitive(3)
    alone = spec.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    free = SamplingParams(max_tokens=20, temperature=0.9, ignore_eos=True)
    outs = spec.generate([prompt_of(9, 2), prompt, prompt, repetitive(4), prompt],
                         [free, seeded, free, GREEDY, free], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].token_ids != outs[4].outputs[0].token_ids
    assert spec.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_sampling_parameters_shape_the_target_distribution(demo_plain):
    """top_k = 1 makes sampling greedy: with speculation too (the target's p is filtered before
    the test); penalties apply per draft position as if the drafts were already emitted."""
    spec = llm(DEMO, speculative_config=NGRAM)
    top1 = SamplingParams(max_tokens=24, temperature=0.8, top_k=1, ignore_eos=True)
    assert tokens(spec.generate(PROMPTS, top1, use_tqdm=False)) == tokens(demo_plain.generate(PROMPTS, GREEDY,
                                                                                              use_tqdm=False))
    rep = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, ignore_eos=True)
    assert tokens(spec.generate(PROMPTS, rep, use_tqdm=False)) == tokens(demo_plain.generate(PROMPTS, rep,
                                                                                             use_tqdm=False))


def test_stops_limits_and_logprobs_inside_an_accepted_run(demo_plain):
    spec = llm(DEMO, speculative_config=NGRAM)
    prompt = repetitive(1)
    full = demo_plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    for params in (SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[full[stop_at]]),
                   SamplingParams(max_tokens=24, temperature=0, min_tokens=12, logprobs=2)):
        want, got = (x.generate([prompt], params, use_tqdm=False)[0].outputs[0] for x in (demo_plain, spec))
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        if params.logprobs:
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
    text = demo_plain.generate(["def add(a, b):"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(max_tokens=24, temperature=0, stop=[stop])
    want, got = (x.generate(["def add(a, b):"], params, use_tqdm=False)[0].outputs[0] for x in (demo_plain, spec))
    assert got.text == want.text and got.finish_reason == "stop"


def test_abort_and_pages_mid_run():
    """Pages beyond a sequence's tokens (written only by rejected drafts) go back after each
    verify step; an abort in the middle of speculation frees everything."""
    spec = llm(DEMO, speculative_config=draft_model(DRAFT))
    engine = spec.engine
    accept = engine.scheduler.accept
    seen = []

    def checked(item, n):
        accept(item, n)
        seq = item.seq
        if not seq.is_finished:
            assert len(seq.page_table) == engine.pages.pages_for(seq.num_tokens)
            assert seq.num_computed_tokens == seq.num_tokens - 1
            seen.append(n)
    engine.scheduler.accept = checked
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    spec.abort(ids[0])
    while engine.has_unfinished():
        engine.step()
    assert seen and engine.pages.num_free_pages == engine.cfg.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft", "eagle3", "mtp"])
def test_gpu_greedy_follows_plain_decoding(proposer, tmp_path):
    """On the GPU (bf16, Triton kernels, decode graphs): a verify step's logits come from other
    kernels than a decode step's, so a near-tie may flip late in a run, never early. MTP drafts
    for a tiny random DeepSeek-V3 with an MTP layer its drafts are often accepted from
    (tests/spec/mtp_reference.py), the others for the demo model."""
    kw = dict(dtype="bfloat16", kv_cache_memory=1 << 28, max_model_len=1024)
    target = DEMO
    if proposer == "mtp":
        from tests.spec.mtp_reference import write_mtp_layer

        from ridge.utils.random_checkpoint import make_random_checkpoint
        target = write_mtp_layer(make_random_checkpoint(str(tmp_path / "deepseekv3"), arch="deepseekv3"), echo=0.7)
    want = tokens(LLM(target, show_progress=False, **kw).generate(PROMPTS, GREEDY, use_tqdm=False))
    spec = LLM(target, show_progress=False, speculative_config=config_of(proposer, DRAFT), **kw)
    always_draft(spec)                 # the demo pair is launch-bound: keep drafting
    outs = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(tokens(outs), want):
        assert a[:8] == b[:8], (a, b)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
