"""The step clock: whether speculating pays at a batch size, judged by the time per emitted token of
the engine's own decode steps, with drafts and without.

The cost model (memory_bound_batch, ridge/engine/spec/speculator.py) does not see host work: a
small model whose decode step is a fraction of a millisecond is bound by launches and the host,
where drafting (a draft model's steps, each read back) and verifying cost more than the tokens
they save. So the engine's decode steps are timed (seconds per emitted token, by batch size, with
and without drafts) and a batch size whose speculating steps are slower per token than plain
ones stops speculating; a run of PROBE_STEPS steps the other way re-times it, every PROBE steps
or more (as many as keep the probes under PROBE_COST of the time), so a change (longer contexts,
better drafts) is noticed (a run, not one step: a verify step emits 1 to k + 1 tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

PROBE = 32            # steps the losing way (speculating or not, per batch size) waits to be re-timed,
MAX_PROBE = 1024      # doubling up to this each time a probe finds it still losing
PROBE_STEPS = 4       # steps a way is timed over (its first timing, a probe): one verify step emits 1..k + 1
PROBE_COST = 0.02     # the most of the time a probe of the losing way may cost, over the steps between probes
MARGIN = 0.03         # speculating steps may be this much slower per token before they stop
CLOCK_DECAY = 0.8     # weight of the timing history per observed step


@dataclass
class _Run:
    """A run of PROBE_STEPS steps timing one way (speculated or not) at one batch size."""
    speculated: bool
    steps_left: int = PROBE_STEPS
    tokens: int = 0
    seconds: float = 0.0
    other_steps: int = 0      # steps of the other way while this run waited


class StepClock:
    """Seconds per emitted token of pure decode steps, by batch size (powers of two) and by whether
    they verified drafts; decides whether speculating pays at a batch size.

    A way is timed over a run of PROBE_STEPS steps (its first timing, and each probe of the losing
    way), and the run's own seconds over its own tokens replace that way's estimate: a verify step
    emits anywhere from 1 to k + 1 tokens, so one step decides nothing, and the losing way's history
    is `interval` steps old by the time it is probed. The winning way, timed every step it runs,
    keeps a decayed average."""

    def __init__(self):
        self.per_token: dict[tuple[int, bool], float] = {}
        self.since: dict[tuple[int, bool], int] = {}     # steps since each way last ran
        self.interval: dict[int, int] = {}                # steps between probes of the losing way
        self.probe: dict[int, _Run] = {}                  # bucket -> the run timing one way now
        self.pending: tuple[str, float] | None = None     # decode time not yet matched with tokens

    @staticmethod
    def bucket(batch: int) -> int:
        return max(batch, 1).bit_length()

    def _spec_wins(self, b: int) -> bool | None:
        spec, plain = self.per_token.get((b, True)), self.per_token.get((b, False))
        return None if spec is None or plain is None else spec <= plain * (1 + MARGIN)

    def time_step(self, kind: str | None, batch: int, tokens: int, seconds: float) -> None:
        """An engine step of `kind` ("plain" or "verify" decode; None for any other, e.g. a prefill)
        that committed `tokens` in `seconds`. A step whose ids stay on the device commits nothing
        yet: its time goes with the step that commits its tokens, if that step is of the same kind."""
        pending = self.pending
        if kind is None or (pending is not None and pending[0] != kind):
            self.pending = None                             # a prefill, or the kind changed: start over
            if kind is None:
                return
        pending = self.pending or (kind, 0.0)
        seconds += pending[1]
        if tokens:
            self.observe(batch, kind == "verify", tokens, seconds)
            self.pending = None
        else:
            self.pending = (kind, seconds)

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        b = self.bucket(batch)
        self.since[(b, speculated)] = 0
        self.since[(b, not speculated)] = self.since.get((b, not speculated), 0) + 1
        run = self.probe.get(b)
        if run is not None and run.speculated == speculated:
            run.steps_left, run.tokens, run.seconds = run.steps_left - 1, run.tokens + tokens, run.seconds + seconds
            if run.steps_left == 0:                              # the run is over: its own figure
                del self.probe[b]
                before = self._spec_wins(b)
                self.per_token[(b, speculated)] = run.seconds / max(run.tokens, 1)
                after = self._spec_wins(b)
                if after is not None:
                    # it re-timed the losing way and that lost again: probe half as often
                    lost = before is not None and before != speculated and after == before
                    grown = min(2 * self.interval.get(b, PROBE), MAX_PROBE) if lost else PROBE
                    self.interval[b] = max(grown, self.affordable_interval(b))
            return
        if run is not None:          # the other way ran (e.g. no sequence had drafts): give the run up
            run.other_steps += 1     # after a while, so a probe nothing can finish does not stay open
            if run.other_steps > 2 * PROBE_STEPS:
                del self.probe[b]
        x, old = seconds / max(tokens, 1), self.per_token.get((b, speculated))
        self.per_token[(b, speculated)] = x if old is None else CLOCK_DECAY * old + (1 - CLOCK_DECAY) * x

    def affordable_interval(self, b: int) -> int:
        """Steps between probes of the losing way that keep a probe's cost under PROBE_COST: a run of
        PROBE_STEPS losing steps takes (1 - winner/loser seconds a token) of its time more than the
        winner would for the same tokens, against the interval's steps (steps of either way taken as
        equally long: a memory-bound verify step costs 1.1-1.3 plain ones). A way that loses by 3x
        is re-timed every ~130 steps, not every 32 (the 70B's 4-step plain probes were ~7% of its steps)."""
        spec, plain = self.per_token[(b, True)], self.per_token[(b, False)]
        ratio = min(spec, plain) / max(spec, plain, 1e-12)
        return min(MAX_PROBE, max(PROBE, math.ceil(PROBE_STEPS * (1 - ratio) / PROBE_COST)))

    def pays(self, batch: int) -> bool:
        """Speculate at this batch size: first a run of each way (drafts first), then while drafts
        are no slower per token, with a run of the losing way every interval steps to re-time it."""
        b = self.bucket(batch)
        if b in self.probe:
            return self.probe[b].speculated
        wins = self._spec_wins(b)
        if wins is None:
            way = (b, True) not in self.per_token                # time the way not yet timed
        elif self.since.get((b, not wins), 0) >= self.interval.get(b, PROBE):
            way = not wins                                       # the loser has waited: re-time it
        else:
            return wins
        self.probe[b] = _Run(way)
        return way
