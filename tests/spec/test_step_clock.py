"""The engine's step clock (ridge/engine/spec/clock.py StepClock): a verify step's cost against a
plain decode step's on this device, by batch size, and the probes that time plain steps; and the
speculator's use of it (k, pauses and retries from acceptance against the measured cost)."""
from __future__ import annotations

import pytest


def test_overhead_is_a_verify_steps_cost_in_plain_steps():
    from ridge.engine.spec.clock import StepClock
    clock = StepClock()
    clock.observe(1, True, seconds=0.003)
    assert clock.overhead(1) is None                      # plain steps not timed yet
    clock.observe(1, False, seconds=0.001)
    assert clock.overhead(1) == pytest.approx(2.0) and clock.overhead(3) is None   # another bucket
    clock.observe(1, True, seconds=0.003, drafts=4)       # drafting at 0.25 plain steps a draft token
    assert clock.overhead(1, draft_cost=0.25) == pytest.approx(2.0 - 0.25 * 2)        # mean drafts: 2
    clock.observe(1, True, seconds=0.1)                   # one slow step (a collection pause): the median
    assert clock.overhead(1) == pytest.approx(2.0)        # of the last WINDOW steps holds
    for _ in range(4):
        clock.observe(1, True, seconds=0.0005)            # faster than plain: no negative overhead
    assert clock.overhead(1) == 0.0


def test_plain_steps_are_probed_first_and_every_probe_verify_steps():
    from ridge.engine.spec.clock import PROBE, PROBE_STEPS, StepClock
    clock = StepClock()
    for _ in range(PROBE_STEPS):                          # nothing timed at batch 4: plain steps first
        assert not clock.pays(4) and clock.pays(64) is False
        clock.observe(4, False, seconds=0.001)
    assert clock.pays(4) and clock.pays(5)                # one bucket: 4..7
    for _ in range(PROBE):
        assert clock.pays(4)
        clock.observe(4, True, seconds=0.002)
    for _ in range(PROBE_STEPS):                          # PROBE verify steps on: plain re-timed
        assert not clock.pays(4)
        clock.observe(4, False, seconds=0.0015)
    assert clock.pays(4) and clock.overhead(4) == pytest.approx(0.002 / 0.00125 - 1)   # median of 8 plain steps
    for _ in range(PROBE - 1):
        clock.observe(4, True, seconds=0.002)
    clock.observe(4, False, seconds=0.001)                # a plain step ran anyway (a paused sequence)
    clock.observe(4, True, seconds=0.002)
    assert clock.pays(4)                                  # so no probe is due


def test_a_step_that_leaves_its_ids_on_the_device_counts_with_the_one_that_commits_them():
    from ridge.engine.spec.clock import StepClock
    clock = StepClock()
    clock.time_step("plain", 1, tokens=0, seconds=0.0002)   # launched ahead, nothing committed
    clock.time_step("plain", 1, tokens=1, seconds=0.0018)   # commits it, launches the next
    assert clock.ways[(1, False)].seconds == pytest.approx(0.001)
    clock.time_step("plain", 1, tokens=0, seconds=0.0002)
    clock.time_step("verify", 1, tokens=5, seconds=0.003, drafts=4)   # the kind changed: dropped
    assert clock.ways[(1, True)].seconds == pytest.approx(0.003) and clock.ways[(1, True)].drafts == 4
    clock.time_step(None, 1, tokens=64, seconds=1.0)                  # a prefill: not a decode step
    assert clock.ways[(1, False)].seconds == pytest.approx(0.001) and clock.pending is None


class _Seq:
    """What the speculator's k and pause reads of a decoding sequence."""
    def __init__(self, seq_id, temperature=0.0, seed=None):
        from types import SimpleNamespace

        from ridge.engine.request import SeqStatus
        from ridge.engine.sampling_params import SamplingParams
        self.seq_id, self.status, self.num_pending, self.grammar = seq_id, SeqStatus.RUNNING, 0, None
        self.request = SimpleNamespace(params=SamplingParams(temperature=temperature, seed=seed), max_tokens=1000,
                                       num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
        self.num_output_tokens, self.num_tokens, self.num_computed_tokens = 10, 50, 49

    def emit(self, n):
        self.num_output_tokens, self.num_tokens, self.num_computed_tokens = (
            self.num_output_tokens + n, self.num_tokens + n, self.num_computed_tokens + n)


def _speculator(k=8):
    from ridge.config import SpeculativeConfig
    from ridge.engine.spec.ngram import NgramProposer
    from ridge.engine.spec.speculator import Speculator
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    return Speculator(spec, NgramProposer(1, 3, k), None, cutoff=64, max_model_len=4096, eos_ids=[])


def test_k_and_pauses_follow_acceptance_against_the_measured_verify_cost():
    """alpha 0.6 pays at the model's overhead (0.1), not where a verify step costs 3 plain steps
    (the demo model on a GPU: launches and host work): there the sequence pauses, retries its
    full k when the pause ends, and pauses twice as long when the retry fails too. A seeded sampler
    keeps the model's overhead (its course may not depend on timings)."""
    from ridge.engine.spec.speculator import PAUSE, expected_tokens
    assert expected_tokens(0.6, 8) / 1.1 > 1 > expected_tokens(0.6, 8) / 3.0
    sp = _speculator()
    seq, seeded = _Seq(1), _Seq(2, temperature=0.8, seed=7)
    for s in (seq, seeded):
        for _ in range(5):
            sp._record(s, 5, 3)                           # alpha 3 / 4 per step, decayed: 0.75
    assert sp._limit(seq, 1) == 0                         # the clock first times plain steps
    for _ in range(4):
        sp.clock.observe(1, False, seconds=0.001)
    assert sp._limit(seq, 1) == 8 and sp._limit(seeded, 1) == 8   # verify steps not timed: the model's cost
    for _ in range(5):
        sp._record(seq, 8, 1)                             # alpha ~0.6 now: pays at the model's cost
        sp._record(seeded, 8, 1)
    acc = sp.acceptance[1]
    assert acc.resume_at == 0 and sp._limit(seq, 1) == 8
    sp.clock.observe(1, True, seconds=0.003)              # a verify step timed: 3 plain steps
    assert sp._limit(seeded, 1) > 0
    assert sp._limit(seq, 1) == 0 and acc.resume_at == seq.num_output_tokens + PAUSE and acc.retry
    seq.emit(PAUSE)
    assert sp._limit(seq, 1) == 8                         # the pause ended: one retry at k
    sp._record(seq, 8, 2)
    assert acc.resume_at == seq.num_output_tokens + 9 + 2 * PAUSE                  # failed: twice as long
    seq.emit(9 + 2 * PAUSE)
    for _ in range(20):
        sp._record(seq, 8, 8)                             # its drafts are all accepted now
    assert not acc.retry and sp._limit(seq, 1) == 8
    sp.clock.observe(1, True, seconds=0.05)               # verify steps got slow: it pauses at once
    sp.clock.observe(1, True, seconds=0.05)
    assert sp.clock.overhead(1) > 8 and sp._limit(seq, 1) == 0 and acc.retry
