"""The engine's step clock (ridge/engine/spec/clock.py StepClock): whether drafting pays at a batch
size, judged on runs of steps, and how often the losing way is re-timed."""
from __future__ import annotations

import math


def test_step_clock_stops_speculation_that_is_slower_and_retries_it():
    from ridge.engine.spec.clock import PROBE, PROBE_COST, PROBE_STEPS, StepClock
    clock = StepClock()
    b = clock.bucket(4)

    def run(way, n, tokens, seconds):
        for _ in range(n):
            assert clock.pays(4) == way
            clock.observe(4, way, tokens=tokens, seconds=seconds)

    run(True, PROBE_STEPS, 2, 0.010)                       # nothing timed: a run of drafting steps, 5 ms a token
    run(False, PROBE_STEPS, 4, 0.004)                      # then a run of plain ones, 1 ms a token
    assert not clock.pays(4) and clock.pays(64)            # slower: off at this batch size only
    # drafting loses 5x: a probe of it (4 steps at 5x the time a token) is spaced to cost PROBE_COST at most
    wait = clock.interval[b]
    assert wait == math.ceil(PROBE_STEPS * (1 - 1 / 5) / PROBE_COST) > PROBE
    run(False, wait - PROBE_STEPS, 4, 0.004)
    run(True, PROBE_STEPS, 2, 0.010)                       # a probe re-times them: slower again
    assert clock.interval[b] == 2 * wait                   # so the next probe waits twice as long
    run(False, 2 * wait, 4, 0.004)
    run(True, PROBE_STEPS, 12, 0.004)                      # now they pay, 3x: plain decoding re-timed that seldom
    assert clock.pays(4) and clock.interval[b] == math.ceil(PROBE_STEPS * (1 - 1 / 3) / PROBE_COST)
    run(True, clock.interval[b] - PROBE_STEPS, 12, 0.004)
    run(False, PROBE_STEPS, 4, 0.0012)                     # a probe finds plain decoding a little faster now: it runs,
    assert not clock.pays(4) and clock.interval[b] == PROBE  # and drafting (10% slower) is re-timed every PROBE steps


def test_step_clock_probes_cost_at_most_probe_cost():
    """The 70B round 3's shape of it: verify steps of 21 ms emitting 3.5 tokens against plain steps of
    19 ms emitting one. Each probe of plain decoding (after the first timing of both ways) costs under
    PROBE_COST of the time since the one before it (a fixed 32-step interval: ~8%)."""
    from ridge.engine.spec.clock import PROBE_COST, PROBE_STEPS, StepClock
    clock = StepClock()
    spent = extra = 0.0
    probes, plain_run = [], 0
    for step in range(1500):
        way = clock.pays(1)
        tokens, seconds = (3.5, 0.021) if way else (1, 0.019)
        clock.observe(1, way, tokens=tokens, seconds=seconds)
        spent += seconds
        if not way:
            extra += seconds - tokens * 0.021 / 3.5      # what drafting would have taken for the same token
        plain_run = 0 if way else plain_run + 1
        if plain_run == PROBE_STEPS:                      # a run of plain steps ended: a first timing or a probe
            probes.append(extra / spent)
            spent = extra = 0.0
    assert len(probes) >= 3 and all(share < PROBE_COST for share in probes[1:]), probes


def test_step_clock_is_not_decided_by_one_unlucky_verify_step():
    """A verify step whose drafts are all rejected emits one token and costs more than a plain step;
    the next ones emit several. The first run of drafting steps is judged as a whole: drafting stays
    on (judging its first step alone turned it off for a probe interval and more: the 70B round 3's
    first measured iteration ran 113 steps for 128 tokens)."""
    from ridge.engine.spec.clock import PROBE_STEPS, StepClock
    clock = StepClock()
    for tokens in [1] + [4] * (PROBE_STEPS - 1):          # 24 ms a verify step
        assert clock.pays(1)
        clock.observe(1, True, tokens=tokens, seconds=0.024)
    for _ in range(PROBE_STEPS):                          # 19 ms a plain step, one token
        assert not clock.pays(1)
        clock.observe(1, False, tokens=1, seconds=0.019)
    assert clock.pays(1)
    clock.observe(1, True, tokens=1, seconds=0.024)       # another unlucky step: the decayed average holds
    assert clock.pays(1)


def test_step_clock_gives_up_a_probe_that_nothing_runs():
    """A probe of drafting whose sequences propose nothing (plain steps run instead) is given up, and
    the plain steps are timed meanwhile."""
    from ridge.engine.spec.clock import PROBE_STEPS, StepClock
    clock = StepClock()
    assert clock.pays(2)
    for _ in range(2 * PROBE_STEPS + 1):
        clock.observe(2, False, tokens=2, seconds=0.002)
    assert clock.bucket(2) not in clock.probe and clock.per_token[(clock.bucket(2), False)] == 0.001
