"""The step clock: what a verify step costs against a plain decode step on this device, measured
from the engine's own steps, by batch size.

Whether drafts pay is acceptance times cost. A sequence whose drafts are accepted with probability
alpha emits expected_tokens(alpha, k) tokens a verify step (speculator.py keeps alpha per
sequence), and a verify step costs `ratio` plain decode steps: the target over k + 1 rows a
sequence, the proposer's host work, the read-back of the target's choices and their commit, none
of which a plain step has (its host work overlaps the GPU's; overlapped decode). The cost model
(memory_bound_batch) does not see the host: a small model whose decode step is a fraction of a
millisecond is bound by launches and the host, where a verify step costs several plain ones, and
only the device's own steps say how many. So the engine's decode steps are timed, seconds a step
by batch size (powers of two) with drafts and without, and the speculator picks each sequence's k
(or a pause) from its acceptance against the measured ratio.

Timing seconds per emitted token of each way instead mixes the two: a run of verify steps over text
the proposer cannot predict reads as drafting being slow everywhere, and turns drafts off for the
text they predict well too (suffix decoding's agent turns: a sequence that matches a file it saw
drafts 16 tokens and has 15 accepted, and the next one matches nothing).

Plain steps are timed whenever they run (a sequence pauses its drafts, a proposer finds nothing);
a batch size whose sequences draft at every step runs a probe of PROBE_STEPS plain steps first and
then every PROBE verify steps, so the ratio follows the context's growth. A probe's cost is at
most PROBE_STEPS * (1 - 1/gain) steps of every PROBE + PROBE_STEPS (about 1% at gain 2).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PROBE = 256           # verify steps at a batch size between timings of its plain steps
PROBE_STEPS = 4       # plain steps a probe times
WINDOW = 16           # a way's last steps its figure is the median of


@dataclass
class _Way:
    """A step of one way (with drafts or without) at one batch size: the median seconds of its last
    WINDOW steps (a collection pause or a late compile is one slow step, and a way that then runs
    seldom, the losing one, would carry a mean's memory of it for long), and for verify steps the
    mean drafts a speculating sequence took (a draft model's cost grows with them)."""
    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    draft_counts: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, seconds: float, drafts: float) -> None:
        self.steps.append(seconds)
        self.draft_counts.append(drafts)

    seconds = property(lambda self: statistics.median(self.steps))
    drafts = property(lambda self: statistics.fmean(self.draft_counts))


@dataclass
class StepClock:
    """Seconds a decode step by batch size, with drafts and without; `pays` is False while a probe
    times plain steps, `overhead` is a verify step's cost over a plain one's less its drafting."""
    ways: dict = field(default_factory=dict)            # (bucket, speculated) -> _Way
    since_plain: dict = field(default_factory=dict)     # bucket -> verify steps since a plain one
    probe: dict = field(default_factory=dict)           # bucket -> plain steps its probe still takes
    pending: tuple | None = None                        # (kind, seconds, steps) not yet matched with tokens

    @staticmethod
    def bucket(batch: int) -> int:
        return max(batch, 1).bit_length()

    def time_step(self, kind: str | None, batch: int, tokens: int, seconds: float, drafts: float = 0.0) -> None:
        """An engine step of `kind` ("plain" or "verify" decode; None for any other, e.g. a prefill)
        that committed `tokens` in `seconds`, its speculating sequences `drafts` drafts each on
        average. A step whose ids stay on the device commits nothing yet: it is counted with the
        step that commits them, if that step is of the same kind (two launches, two steps' time)."""
        pending = self.pending
        if kind is None or (pending is not None and pending[0] != kind):
            self.pending = None                             # a prefill, or the kind changed: start over
            if kind is None:
                return
        _, before, steps = self.pending or (kind, 0.0, 0)
        if tokens:
            self.observe(batch, kind == "verify", (before + seconds) / (steps + 1), drafts)
            self.pending = None
        else:
            self.pending = (kind, before + seconds, steps + 1)

    def observe(self, batch: int, speculated: bool, seconds: float, drafts: float = 0.0) -> None:
        """One decode step's seconds at this batch size."""
        b = self.bucket(batch)
        self.ways.setdefault((b, speculated), _Way()).add(seconds, drafts)
        if speculated:
            self.since_plain[b] = self.since_plain.get(b, 0) + 1
            return
        self.since_plain[b] = 0
        if b in self.probe:
            self.probe[b] -= 1
            if self.probe[b] == 0:
                del self.probe[b]

    def pays(self, batch: int) -> bool:
        """Whether sequences may draft at this batch size now: not while a probe times plain steps
        (one starts when plain steps were never timed here, or PROBE verify steps ago)."""
        b = self.bucket(batch)
        if b not in self.probe and ((b, False) not in self.ways or self.since_plain.get(b, 0) >= PROBE):
            self.probe[b] = PROBE_STEPS
        return b not in self.probe

    def overhead(self, batch: int, draft_cost: float = 0.0) -> float | None:
        """A verify step's cost in plain decode steps, less one and less the drafting it measured
        (draft_cost plain steps a draft token): what best_k adds to 1 + draft_cost * k. None until
        both ways are timed at this batch size."""
        b = self.bucket(batch)
        verify, plain = self.ways.get((b, True)), self.ways.get((b, False))
        if verify is None or plain is None or plain.seconds <= 0:
            return None
        return max(0.0, verify.seconds / plain.seconds - 1 - draft_cost * verify.drafts)
