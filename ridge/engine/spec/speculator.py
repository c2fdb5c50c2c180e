"""Speculative decoding, the engine's side: which sequences speculate this step and with how many
drafts, the target's verification of the drafts, and the counters vLLM reports.

A step with drafts is an ordinary step of the engine's loop, entered through `Speculator.step`
(a SpecStep around the step): before the schedule, `plan` asks the proposer for each decoding
sequence's drafts (stored on the sequence); the scheduler schedules the sequence's last token plus
its drafts as one chunk (pages for all of them; drafts past the token budget are dropped); the
runner computes that chunk through the paged attention kernels like any multi-token chunk and
returns logits for its last num_draft + 1 rows; `verify` turns them into the target's
distributions (sampling parameters and penalties applied per position, rejection.py) and keeps
the prefix that exact rejection sampling accepts, plus one token from the target. The engine
commits those tokens one position at a time (Committer.commit_runs: stop tokens, stop strings and
max_tokens cut an accepted run where plain decoding would), and the scheduler then sets the
sequence's cache length to the last accepted draft and returns the pages only rejected drafts used.

When it runs. Speculation pays while a verify pass over k + 1 tokens a sequence costs about one
decode step, i.e. while it is memory-bound (seed 002: the weights are read once per pass whatever
the row count). `memory_bound_batch` finds the largest batch for which the model's own cost model
(`model.cost`, the roofline's) puts a verify step's FLOPs at the measured matmul roof under its
bytes at the measured bandwidth; above it no sequence speculates (vLLM's `disable_by_batch_size`,
which overrides it). Below it, the step clock (clock.py) times the engine's decode steps, with
drafts and without, and gives a verify step's cost in plain steps on this device. Per sequence,
the drafts' measured acceptance sets k: the geometric-run estimate alpha = accepted / (accepted +
rejections) over a decaying window (used once MIN_TRIALS trials are in) picks the k that maximises
the expected tokens per unit of verify cost,
(1 - alpha^(k+1)) / (1 - alpha) over (1 + overhead + draft_cost * k) (overhead: the clock's, OVERHEAD
until it has timed both ways), and a sequence whose best is under one token per plain step pauses
for PAUSE tokens (doubling while it keeps failing), then tries again.

Determinism. The acceptance state is the sequence's own and the pause is counted in its own
tokens, so a seeded request speculates the same way alone or in any batch; the batch-size cutoff
and the step clock would break that, so a seeded request that samples (temperature > 0) is
exempt from both (its overhead is OVERHEAD). Greedy
requests give plain decoding's tokens whether they speculate or not.

Structured outputs. A sequence held to a grammar speculates too: `plan` cuts its drafts at the first
one the grammar rejects and after one that ends it (structured.allowed_drafts), and `verify` masks
each of its k + 1 rows with the grammar's state after the drafts before that row (mask_runs) before
anything reads them; a draft model draws from q masked the same way. Mask filling walks the matcher
and rolls it back; only the commit of each emitted token advances it, so a rejected draft leaves
nothing to undo, and a grammar that ends inside an accepted run ends the sequence there as a stop
token does (Committer.commit_runs). Greedy outputs under a grammar are plain decoding's.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from ridge.config import EngineConfig, ModelConfig, SpeculativeConfig
from ridge.engine.request import Sequence, SeqStatus
from ridge.engine.spec.clock import StepClock
from ridge.engine.spec.metrics import SpecCounters, record
from ridge.engine.spec.ngram import NgramProposer
from ridge.engine.spec.proposer import Proposal, Proposer
from ridge.engine.spec.rejection import target_probs, verify
from ridge.engine.spec.suffix import SuffixProposer
from ridge.engine.structured import allowed_drafts
from ridge.layers.cost import StepShape
from ridge.layers.sampler import info_on_host, logprob_info
from ridge.runner.model_runner import plain_greedy

OVERHEAD = 0.1        # a verify step's extra cost over a plain decode step until the clock has timed both
PAUSE = 16            # output tokens a sequence goes without drafts after its drafts stop paying
MAX_PAUSE = 256
DECAY = 0.8           # weight of the acceptance history per verify step
MIN_TRIALS = 3.0      # decayed trials before the acceptance estimate sets k or pauses
VERIFY_CONTEXT = 1024  # the context length the cutoff's cost model assumes



@dataclass
class Acceptance:
    """A sequence's recent drafts: accepted tokens and trials (accepted + rejections), decayed."""
    accepted: float = 0.0
    trials: float = 0.0
    resume_at: int = 0          # output length before which the sequence does not speculate
    pause: int = PAUSE
    retry: bool = False         # a pause is on or just ended: its next step drafts (at k) to re-measure

    def pause_from(self, output_len: int) -> None:
        """Pause from this output length; the history stays, so a failed retry pauses again, longer."""
        self.resume_at, self.pause, self.retry = output_len + self.pause, min(2 * self.pause, MAX_PAUSE), True

    # None until MIN_TRIALS (decayed) trials: one early rejection must not pause a good proposer
    alpha = property(lambda self: self.accepted / self.trials if self.trials >= MIN_TRIALS else None)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step emits with k drafts each accepted with probability alpha (seed 002)."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def best_k(alpha: float | None, k: int, draft_cost: float, overhead: float = OVERHEAD) -> int:
    """The number of drafts that maximises tokens per unit of cost (a verify step with j drafts costs
    1 + overhead + draft_cost * j plain steps); 0 when none beats plain decoding."""
    if alpha is None:
        return k
    gain = {j: expected_tokens(alpha, j) / (1 + overhead + draft_cost * j) for j in range(1, k + 1)}
    j = max(gain, key=gain.get)
    return j if gain[j] > 1 else 0


def memory_bound_batch(model, k: int, dtype: torch.dtype, ceilings, max_num_seqs: int) -> int:
    """The largest batch (<= max_num_seqs) whose verify step (k + 1 tokens a sequence) the model's
    cost puts under its memory time at the measured ceilings; 0 if not even one sequence's is."""
    def memory_bound(b: int) -> bool:
        costs = model.cost(StepShape((k + 1,) * b, (VERIFY_CONTEXT,) * b, dtype=dtype))
        return sum(c.flops / ceilings.peak(c.compute) for c in costs) <= sum(c.bytes for c in costs) / ceilings.bandwidth
    lo, hi = 0, max_num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if memory_bound(mid) else (lo, mid - 1)
    return lo


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, runner, cutoff: int, max_model_len: int,
                 eos_ids: list[int], draft_cost: float = 0.0):
        self.k, self.proposer, self.runner, self.cutoff = spec.num_speculative_tokens, proposer, runner, cutoff
        self.max_model_len, self.eos_ids, self.draft_cost = max_model_len, eos_ids, draft_cost
        self.acceptance: dict[int, Acceptance] = {}
        self.clock = StepClock()                # ridge/engine/spec/clock.py: a verify step's cost here
        self.batch = 1                          # running sequences at the last plan
        self.proposal: Proposal | None = None
        self.rows: dict[int, int] = {}          # seq_id -> its row in the proposal
        self.proposed: set[int] = set()         # sequences the proposer may keep state for
        self.counters = SpecCounters(spec.method)   # totals since start (ridge/engine/spec/metrics.py)
        self.grammars = None                        # the engine's (attach): structured outputs' masks

    def attach(self, pages, grammars) -> None:
        """The engine's page allocator, for a proposer that writes on the target's pages (EAGLE-3),
        and its Grammars (ridge/engine/structured.py, None without a tokenizer), whose masks verify
        and a draft model put on their logits."""
        self.grammars = grammars
        attach = getattr(self.proposer, "attach", None)
        if attach is not None:
            attach(pages, grammars)

    def step(self, scheduler, committer, overlapped: bool) -> "SpecStep":
        """The engine's one call per step, before its schedule: the step's speculation (a context
        around the step; see SpecStep)."""
        return SpecStep(self, scheduler, committer, overlapped)

    def _limit(self, seq: Sequence, batch: int, decoding: bool = True) -> int:
        """Drafts the sequence may take this step (0: it does not speculate); `decoding`: only if
        its prompt is done and its last token is all it has left to compute."""
        p = seq.request.params
        if decoding and (seq.num_pending or seq.num_computed_tokens != seq.num_tokens - 1):
            return 0
        if seq.status != SeqStatus.RUNNING or seq.num_output_tokens < p.min_tokens:   # min_tokens bans stops
            return 0                                                                   # per position
        if (batch > self.cutoff or not self.clock.pays(batch)) and not (p.seed is not None and p.temperature > 0):
            return 0
        if seq.grammar is not None and seq.grammar_after is not None:
            return 0          # its grammar starts inside the text to come: drafts could not be checked
        if seq.grammar is not None and not self.proposer.masks_grammar and not plain_greedy(seq):
            return 0          # a cut draw from an unmasked q would bias the sampling (proposer.py)
        acc = self.acceptance.get(seq.seq_id)
        if acc is not None and seq.num_output_tokens < acc.resume_at:
            return 0
        k = best_k(acc.alpha if acc is not None else None, self.k, self.draft_cost, self._overhead(seq, batch))
        if k == 0 and acc is not None:
            if not acc.retry:         # the costs changed under it (the clock timed a step): pause now
                acc.pause_from(seq.num_output_tokens)
                return 0
            k = self.k                # a pause ended: one retry, whose verify step re-measures both
        return max(0, min(k, seq.request.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def _overhead(self, seq: Sequence, batch: int) -> float:
        p = seq.request.params
        measured = None if p.seed is not None and p.temperature > 0 else self.clock.overhead(batch, self.draft_cost)
        return OVERHEAD if measured is None else measured

    def active(self, seqs: list[Sequence]) -> bool:
        """Whether any of these running sequences would get drafts at its next decode step (the
        engine then does not launch that step ahead of this one's ids: drafts need them)."""
        return any(self._limit(s, len(seqs), decoding=False) for s in seqs)

    def plan(self, running: list[Sequence]) -> None:
        """Before the schedule: ask the proposer for the drafts of this step's speculating sequences.
        Drafts left from an earlier step (a sequence the token budget did not reach) are dropped:
        they belong to an earlier proposal. Sequences no longer running leave the proposer's state."""
        live = {s.seq_id for s in running}
        gone = (self.proposed | set(self.acceptance)) - live
        for i in gone:
            self.acceptance.pop(i, None)
        self.proposed -= gone
        self.proposer.release(gone)
        for s in running:
            s.draft_token_ids = []
        self.batch = len(running)
        limits = [(s, self._limit(s, len(running))) for s in running]
        seqs, limits = [s for s, lim in limits if lim], [lim for _, lim in limits if lim]
        self.proposal, self.rows = None, {}
        if not seqs:
            return
        t0 = time.perf_counter()
        self.proposal = self.proposer.propose(seqs, limits)
        self.counters.propose_seconds += time.perf_counter() - t0
        for row, (seq, tokens, lim) in enumerate(zip(seqs, self.proposal.tokens, limits)):
            drafts = list(tokens[:lim])
            if seq.grammar is not None:     # cut at the first draft its grammar rejects (see verify)
                drafts = drafts[:allowed_drafts(seq.grammar, drafts)]
            seq.draft_token_ids = drafts
            self.rows[seq.seq_id] = row
            self.proposed.add(seq.seq_id)

    @torch.inference_mode()
    def verify(self, items: list, logits: torch.Tensor) -> tuple[list[list[int]], list[list[tuple | None]]]:
        """items: the step's scheduled items with drafts; logits: their rows, num_draft + 1 each,
        in order. Returns each item's emitted tokens and, per emitted token, its logprob info
        (the sampler's (chosen, rank, top values, top ids) for that row, or None).

        Under a grammar (structured outputs) each row is first masked with the grammar's state after
        the drafts before it (Grammars.mask_runs), so p at position i is the constrained distribution plain
        decoding would sample there had drafts[:i] been emitted, and what follows holds for it:
        rejection sampling is exact for any q, and its accepted, resampled (max(0, p - q): zero
        where p is) and bonus tokens all lie within the grammar. The drafts were cut (plan) at the
        first one the grammar rejects and after one that ends it. The cut changes nothing: a point
        mass on x with p(x) = 0 is rejected for sure and its residual is p itself, the bonus draw a
        cut row gets; a draft model draws from q masked by the same states (draft_model.py), so it
        never proposes such a draft (an unmasked q cut there would be biased: a draft outside the
        grammar says q's mass went there, and p instead of the residual over-weights q's choices);
        drafts after the grammar's end count only if its end is accepted, and the sequence ends there."""
        seqs = [i.seq for i in items]
        if self.grammars is not None:
            self.grammars.mask_runs(logits, seqs, [s.draft_token_ids[:i.num_draft] for s, i in zip(seqs, items)])
        if all(map(plain_greedy, seqs)):
            return self._verify_greedy(items, logits)
        n, k, vocab, dev = len(items), max(i.num_draft for i in items), logits.shape[-1], logits.device
        slots = [r * (k + 1) + j for r, i in enumerate(items) for j in range(i.num_draft + 1)]
        full = logits.new_zeros(n * (k + 1), vocab)
        full[torch.tensor(slots, device=dev)] = logits
        drafts = torch.tensor([s.draft_token_ids[:i.num_draft] + [-1] * (k - i.num_draft) for s, i in zip(seqs, items)],
                              dtype=torch.int64).to(dev)
        batch = self.runner.sampling_batch(seqs, vocab, self.eos_ids)
        p = target_probs(full.view(n, k + 1, vocab), batch, drafts)
        q = None
        if self.proposal is not None and self.proposal.probs is not None:
            q = self.proposal.probs[torch.tensor([self.rows[s.seq_id] for s in seqs], device=dev), :k].to(p.dtype)
        tokens, emitted = verify(drafts, q, p, batch.seeds, batch.steps, batch.temperature == 0,
                                 torch.tensor([i.num_draft for i in items], device=dev))
        info = None
        if batch.max_logprobs >= 0:
            info = info_on_host(logprob_info(full, tokens.clamp(min=0).view(-1), batch.max_logprobs))
        tokens, emitted = tokens.tolist(), emitted.tolist()
        out, infos = [], []
        for r, (item, e) in enumerate(zip(items, emitted)):
            out.append(tokens[r][:e])
            infos.append([None if info is None else tuple(t[r * (k + 1) + j] if t is not None else None for t in info)
                          for j in range(e)])
            self._record(item.seq, item.num_draft, e - 1)
        return out, infos

    def _verify_greedy(self, items: list, logits: torch.Tensor) -> tuple[list[list[int]], list[list[None]]]:
        """verify's greedy rule without the distributions: accept drafts while they equal the
        target's argmax, then emit its argmax. One argmax over the rows and one read-back (the
        sampling tensors, the point masses over the vocabulary and verify's ~40 small kernels
        are host and launch time a greedy batch does not need)."""
        best, out, at = logits.argmax(dim=-1).tolist(), [], 0
        for item in items:
            d, drafts = item.num_draft, item.seq.draft_token_ids
            row, at = best[at:at + d + 1], at + d + 1
            accepted = next((j for j in range(d) if drafts[j] != row[j]), d)
            out.append(row[:accepted + 1])
            self._record(item.seq, d, accepted)
        return out, [[None] * len(e) for e in out]

    def _record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        acc = self.acceptance.setdefault(seq.seq_id, Acceptance())
        acc.accepted = DECAY * acc.accepted + accepted
        acc.trials = DECAY * acc.trials + accepted + (accepted < drafted)
        if best_k(acc.alpha, self.k, self.draft_cost, self._overhead(seq, self.batch)) == 0:
            acc.pause_from(seq.num_output_tokens + drafted + 1)
        else:
            acc.pause, acc.retry = PAUSE, False
        record(self.counters, seq.request, drafted, accepted)


@dataclass
class Verified:
    """A step's sampling items after verification: those with drafts, each one's emitted tokens
    (accepted drafts, then the target's own) and per token its logprob info or None; and for the
    items without drafts (a prompt's last chunk, a decode without drafts), in order, the logits row
    each samples from as in a plain step."""
    items: list
    tokens: list[list[int]]
    infos: list[list[tuple | None]]
    plain_rows: list[int]


class SpecStep:
    """One engine step's speculation, entered before the schedule and left when the step has
    committed. On entry it plans the step's drafts (the proposer's, stored on the sequences the
    scheduler then schedules with them), or, for a step that commits an overlapped one, decides
    whether the next step drafts (`drafts_next`: the engine then launches no step ahead, drafts need
    its ids). `verify` turns the forward's logits into each drafted sequence's tokens. On leaving, the
    step's time goes to the step clock ("plain" or "verify" decode steps; `kind`)."""

    def __init__(self, spec: Speculator, scheduler, committer, overlapped: bool):
        self.spec, self.scheduler, self.committer = spec, scheduler, committer
        self.t0, self.tokens0, self.batch = time.perf_counter(), committer.generation_tokens, len(scheduler.running)
        self.kind: str | None = None
        self.drafts, self.drafts_next = 0.0, False
        if overlapped:
            self.kind, self.drafts_next = "plain", spec.active(scheduler.running)
        else:
            spec.plan(scheduler.running)
        self.asked = not overlapped and spec.proposal is not None

    def __enter__(self) -> "SpecStep":
        return self

    def __exit__(self, error, *_) -> None:
        if error is None:
            # a plain step whose sequences were asked for drafts and got none is not a plain step's
            # cost (its host work proposed and did not overlap the GPU's), nor a verify step's
            kind = None if self.kind == "plain" and self.asked else self.kind
            self.spec.clock.time_step(kind, self.batch, self.committer.generation_tokens - self.tokens0,
                                      time.perf_counter() - self.t0, self.drafts)

    def keeps_drafting(self) -> bool:
        """After a plain decode step: whether a running sequence gets drafts at its next step."""
        return self.spec.active(self.scheduler.running)

    def verify(self, items: list, logits: torch.Tensor, decoding: bool) -> Verified:
        """items: the step's sampling items, num_draft + 1 rows of `logits` each, in order; `decoding`:
        every scheduled sequence decodes (a verify step the clock times)."""
        self.kind = "verify" if decoding else None
        ends = list(itertools.accumulate(i.num_draft + 1 for i in items))
        spec = [i for i in items if i.num_draft]
        self.drafts = sum(i.num_draft for i in spec) / len(spec)
        rows = [r for e, i in zip(ends, items) if i.num_draft for r in range(e - i.num_draft - 1, e)]
        tokens, infos = self.spec.verify(spec, logits[self.spec.runner.to_device(rows, torch.int64)])
        return Verified(spec, tokens, infos, [e - 1 for e, i in zip(ends, items) if not i.num_draft])


def build_speculator(cfg: EngineConfig, model_cfg: ModelConfig, runner, show_progress: bool):
    """(the Speculator for cfg.speculative_config, its draft runner or None), after the target's
    runner is built and before the KV pools are sized (a draft model's pool shares the budget)."""
    spec = cfg.speculation
    if spec is None:
        return None, None
    eos = list(model_cfg.eos_token_ids)
    draft_runner = None
    if spec.method == "ngram":
        proposer, draft_cost = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                             spec.num_speculative_tokens), 0.0
    elif spec.method == "suffix":
        proposer, draft_cost = SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_spec_factor,
                                              spec.suffix_decoding_min_token_prob,
                                              spec.suffix_decoding_max_cached_requests), 0.0
    else:
        from ridge.runner.model_runner import ModelRunner
        if spec.method in ("eagle3", "mtp"):
            from ridge.engine.spec.eagle import HeadProposer, head_config
            draft_runner = ModelRunner(*head_config(cfg, spec, model_cfg), show_progress=show_progress)
            proposer = HeadProposer(draft_runner, runner, eos, spec.num_speculative_tokens)
        else:
            from ridge.engine.spec.draft_model import DraftModelProposer, draft_config
            draft_runner = ModelRunner(*draft_config(cfg, spec), show_progress=show_progress)
            proposer = DraftModelProposer(draft_runner, eos)
        one = StepShape((1,), (1,), dtype=cfg.dtype)
        draft_cost = sum(c.param_bytes for c in draft_runner.model.cost(one)) / \
            sum(c.param_bytes for c in runner.model.cost(one))
    cutoff = spec.disable_by_batch_size
    if cutoff is None:
        from ridge.utils.ceilings import load_ceilings
        cutoff = memory_bound_batch(runner.model, spec.num_speculative_tokens, cfg.dtype, load_ceilings(cfg.device),
                                    cfg.max_num_seqs)
    return Speculator(spec, proposer, runner, cutoff, cfg.max_model_len, eos, draft_cost), draft_runner
