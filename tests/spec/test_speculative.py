"""Speculative decoding in the engine (ridge/engine/spec/): greedy identity with both
proposers, the sampled distribution, seeds, sampling parameters, stops and limits in the middle of
an accepted run, pages, adaptation and metrics."""
import math
import os

import pytest
import torch
from tests.tests_support import prompt_of

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from ridge.engine.spec.speculator import best_k, expected_tokens, memory_bound_batch
from ridge.engine.spec.proposer import Proposal

DEMO = demo_model_path()
DRAFT = os.path.join(os.path.dirname(DEMO), "demo-code-3m")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
EAGLE3 = {"method": "eagle3", "model": "demo-code-12m-eagle3", "num_speculative_tokens": 4}   # the demo model's head
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def draft_model(path, k=3):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def config_of(proposer: str, draft: str) -> dict:
    return {"ngram": NGRAM, "suffix": SUFFIX, "eagle3": EAGLE3}.get(proposer) or draft_model(draft)


def repetitive(salt: int, n: int = 40) -> list[int]:
    """Prompts that repeat a phrase, so prompt lookup finds matches."""
    return (prompt_of(7, salt) * 8)[:n]


PROMPTS = [repetitive(i) for i in range(3)] + [prompt_of(21, 5), prompt_of(3, 6)]


def llm(model, **kw):
    """An engine; with speculation, drafts run at their model cost (always_draft) and, unless the
    config sets disable_by_batch_size, no batch size turns them off: whether they pay on this
    machine (in time, or by the batch cutoff from its measured ceilings) is the clock's and
    memory_bound_batch's own test, the rest of this file checks what they do."""
    engine_llm = LLM(model, device="cpu", show_progress=False, max_model_len=256, **kw)
    if engine_llm.engine.speculator is not None:
        always_draft(engine_llm)
        if "disable_by_batch_size" not in (kw.get("speculative_config") or {}):
            engine_llm.engine.speculator.cutoff = engine_llm.engine.cfg.max_num_seqs
    return engine_llm


def always_draft(engine_llm):
    """Drafts at every step and batch size, k set by acceptance at the model's OVERHEAD (not by
    what verify steps measure on this machine)."""
    clock = engine_llm.engine.speculator.clock
    clock.pays, clock.overhead = (lambda batch: True), (lambda batch, draft_cost=0.0: None)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def pair(checkpoints):
    """(target, draft) random checkpoints with one vocabulary and different weights."""
    return checkpoints("llama"), checkpoints("qwen2")


@pytest.fixture(scope="module")
def demo_plain():
    return llm(DEMO)


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


class Wrong:
    """A proposer a benchmark might plug in: always the same (wrong) token."""
    masks_grammar = True      # point masses

    def __init__(self):
        self.calls = 0

    def propose(self, seqs, limits):
        self.calls += 1
        return Proposal([[3] * lim for lim in limits])

    def release(self, seq_ids):
        pass


def test_adaptation_pauses_failing_drafts_and_batch_cutoff(demo_plain):
    spec = llm(DEMO, speculative_config=NGRAM)
    wrong = Wrong()
    spec.engine.speculator.proposer = wrong
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    out = spec.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == demo_plain.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out.metrics.num_accepted_tokens == 0 and 3 < out.metrics.num_drafts < 10     # paused, then retried

    capped = llm(DEMO, speculative_config={**NGRAM, "disable_by_batch_size": 1})
    seeded = SamplingParams(max_tokens=24, temperature=0.7, seed=3, ignore_eos=True)
    outs = capped.generate(PROMPTS[:3], [GREEDY, GREEDY, seeded], use_tqdm=False)
    assert [o.metrics.num_drafts for o in outs[:2]] == [0, 0]      # three running: over the cutoff
    assert outs[2].metrics.num_drafts > 0                          # a seeded sampler keeps its own course


def test_k_follows_acceptance_and_the_cutoff_follows_the_roofline():
    assert best_k(None, 4, 0.0) == 4 and best_k(0.95, 4, 0.0) == 4
    assert 1 <= best_k(0.5, 8, 0.05) < 8 and best_k(0.02, 4, 0.0) == 0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2) and expected_tokens(1.0, 3) == 4
    llm = LLM(DEMO, device="cpu", show_progress=False)     # held: a dropped LLM gives its model back
    model = llm.engine.runner.model

    class Roof:
        def __init__(self, flops, bandwidth):
            self.flops, self.bandwidth = flops, bandwidth

        def peak(self, compute):
            return self.flops
    cutoffs = [memory_bound_batch(model, 4, torch.float32, Roof(flops, 1e12), 512) for flops in (1e11, 1e13, 1e14)]
    assert cutoffs[0] == 0 and 0 < cutoffs[1] < 512 and cutoffs[2] == 512     # the more FLOPs per byte, the later
    assert memory_bound_batch(model, 8, torch.float32, Roof(1e13, 1e12), 512) < cutoffs[1]   # more drafts: earlier


def test_metrics_names():
    from prometheus_client import generate_latest

    from ridge.engine.engine import EngineStats
    from ridge.server.metrics import ServerMetrics
    stats = EngineStats(1, 0, 10, 5, 0.5, 0, 3, 4, 0, 0, spec_num_drafts=2, spec_num_draft_tokens=8,
                        spec_num_accepted_tokens=5, spec_accepted_per_pos=(2, 2, 1), spec_propose_seconds=0.25,
                        spec_method="suffix")
    text = generate_latest(ServerMetrics(lambda: stats, lambda: True).registry).decode()
    for name, value in (("ridge_spec_decode_num_drafts_total", 2), ("ridge_spec_decode_num_draft_tokens_total", 8),
                        ("ridge_spec_decode_num_accepted_tokens_total", 5),
                        ("ridge_spec_decode_propose_seconds_total", 0.25)):
        assert f'{name}{{method="suffix"}} {float(value)}' in text
    for pos, n in enumerate((2, 2, 1)):
        assert f'ridge_spec_decode_num_accepted_tokens_per_pos_total{{method="suffix",position="{pos}"}} {float(n)}' in text
    assert stats.spec_acceptance_rate == 5 / 8 and stats.spec_mean_accepted_length == 1 + 5 / 2
    plain = generate_latest(ServerMetrics(lambda: EngineStats(1, 0, 10, 5, 0.5, 0, 3, 4, 0, 0),
                                          lambda: True).registry).decode()
    assert "spec_decode" not in plain                      # no speculative_config: no such series


def test_counters_per_position_and_draft_cost(demo_plain):
    """The engine's totals: accepted drafts by position sum to the accepted tokens, position i counts
    no more steps than position i - 1, and the proposer's host time is counted."""
    spec = llm(DEMO, speculative_config=NGRAM)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    spec.generate(PROMPTS[:3], params, use_tqdm=False)
    st = spec.engine.stats()
    assert st.spec_method == "ngram" and st.spec_num_accepted_tokens > 0 and st.spec_propose_seconds > 0
    per_pos = st.spec_accepted_per_pos
    assert sum(per_pos) == st.spec_num_accepted_tokens and list(per_pos) == sorted(per_pos, reverse=True)
    assert len(per_pos) <= 4 and per_pos[0] <= st.spec_num_drafts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft", "eagle3"])
def test_gpu_greedy_follows_plain_decoding(proposer):
    """On the GPU (bf16, Triton kernels, decode graphs): a verify step's logits come from other
    kernels than a decode step's, so a near-tie may flip late in a run, never early."""
    kw = dict(dtype="bfloat16", kv_cache_memory=1 << 28, max_model_len=1024)
    want = tokens(LLM(DEMO, show_progress=False, **kw).generate(PROMPTS, GREEDY, use_tqdm=False))
    spec = LLM(DEMO, show_progress=False, speculative_config=config_of(proposer, DRAFT), **kw)
    always_draft(spec)                 # the demo pair is launch-bound: keep drafting
    outs = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(tokens(outs), want):
        assert a[:8] == b[:8], (a, b)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


class Slow:
    """Proposes the right tokens (a recorded continuation), but slowly: each proposal moves the
    engine's step clock on by `seconds` (no real sleep, so no CPU load can make it look fast)."""
    masks_grammar = True      # point masses

    def __init__(self, records, clock, seconds=10.0):
        self.records, self.clock, self.seconds = records, clock, seconds

    def propose(self, seqs, limits):
        self.clock.offset += self.seconds
        return Proposal([self.records[tuple(s.token_ids[:s.num_prompt_tokens])][s.num_output_tokens:][:lim]
                         for s, lim in zip(seqs, limits)])

    def release(self, seq_ids):
        pass


class _ShiftedClock:
    """The engine's time module, perf_counter moved on by offset seconds."""

    def __init__(self):
        import time
        self.offset, self._time = 0.0, time

    def perf_counter(self):
        return self._time.perf_counter() + self.offset

    def monotonic(self):
        return self._time.monotonic()


def test_drafts_that_cost_more_time_than_they_save_stop(demo_plain, monkeypatch):
    """All drafts are accepted, but proposing takes longer than the tokens it saves: once the clock
    has timed a verify step against plain ones, the sequence pauses its drafts, twice as long at
    each retry, and its tokens stay plain decoding's."""
    import ridge.engine.spec.speculator as engine_module     # where the engine's steps are timed
    from ridge.engine.spec.clock import PROBE_STEPS
    from ridge.engine.spec.speculator import PAUSE
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    want = demo_plain.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(DEMO, device="cpu", show_progress=False, max_model_len=256, speculative_config=NGRAM)
    clock = _ShiftedClock()
    monkeypatch.setattr(engine_module, "time", clock)
    # a draft step emits at most k + 1 = 5 tokens in 10 s of the clock: 2 s a token, which no plain
    # step of the demo model takes
    spec.engine.speculator.proposer = Slow({tuple(PROMPTS[3]): want}, clock)
    out = spec.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    # PROBE_STEPS plain steps timed first; a verify step (at the model's OVERHEAD until one is timed);
    # timed, it pauses the sequence PAUSE tokens; a retry, then 2 * PAUSE, which ends at the 63rd
    # token (1 + PROBE_STEPS + 5 + PAUSE + 5 + 2 * PAUSE), where one token is left: no third verify
    assert 1 + PROBE_STEPS + 5 + PAUSE + 5 + 2 * PAUSE == 63
    assert out.metrics.num_drafts == 2
    assert spec.engine.speculator.clock.overhead(1) > 100
    assert out.metrics.num_accepted_tokens == 4 * out.metrics.num_drafts
