"""Speculation that adapts (ridge/engine/spec/): drafts that fail pause, a batch over the cutoff
stops them, k follows acceptance and the cutoff the roofline, drafts that cost more time than they
save stop; and the counters and metrics it reports."""
import pytest
import torch
from tests.spec.spec_support import DEMO, GREEDY, NGRAM, PROMPTS, llm

from ridge import LLM, SamplingParams
from ridge.engine.spec.proposer import Proposal
from ridge.engine.spec.speculator import best_k, expected_tokens, memory_bound_batch


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
