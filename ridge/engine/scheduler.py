"""Continuous batching: each step picks which sequences run and how many tokens each computes.

Policy, per step, under a token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`):
  1. running sequences first, oldest first: a decode needs one token, an unfinished prefill its
     next chunk of the budget. If the pool has no page for one, the most recently admitted running
     sequence is preempted (pages freed; recomputed later, to the same output) until there is;
  2. then waiting sequences, in arrival order (preempted ones first), each starting after its
     prefix-cache hits, while budget, seats and pages last. A long prompt is admitted with as much
     as the budget allows and continues next step (chunked prefill), sharing steps with the running
     decodes instead of stalling them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ridge.engine.pages import PageAllocator
from ridge.engine.request import Request, Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int             # of which the last num_draft are the sequence's draft tokens
    num_draft: int = 0
    start = property(lambda self: self.seq.num_computed_tokens)
    # the chunk reaches the end of the sequence (and its drafts), so its last logits are sampled:
    # with drafts, the last num_draft + 1 rows, which the speculative verification reads
    samples = property(lambda self: self.seq.num_computed_tokens + self.num_new_tokens
                       == self.seq.num_tokens + self.num_draft)


def seats(seq: Sequence) -> int:
    """The seats a running sequence holds: a request with n samples forks into n sequences once its
    prompt is done, so until then its first sequence holds all n (the forks must find seats)."""
    return 1 if seq.sample_index or seq.num_output_tokens else seq.request.params.n


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, pages: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.pages, self.max_num_seqs, self.max_num_batched_tokens = pages, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            todo = seq.num_tokens - seq.num_computed_tokens
            n = min(todo + len(seq.draft_token_ids), budget)
            del seq.draft_token_ids[max(0, n - todo):]           # drafts past the budget are dropped
            while self.pages.pages_needed(seq, n) > self.pages.num_free_pages:
                victim = self.running.pop()
                self.pages.free(victim)
                victim.draft_token_ids = []
                victim.status = SeqStatus.WAITING
                self.waiting.appendleft(victim)
                out.preempted.append(victim)
                self.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                break
            self.pages.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n, len(seq.draft_token_ids)))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.page_copies = self.pages.take_pending_copies()
        return out

    def schedule_decode(self, seqs: list[Sequence]) -> SchedulerOutput | None:
        """One decode token for each of `seqs`, decided while the previous step's sampled ids are
        still on the GPU (the engine's overlapped decode). No preemption and no admission here:
        if the budget or the pool falls short, None, and the regular schedule() decides once the
        previous step is known."""
        if len(seqs) > self.max_num_batched_tokens or \
                sum(self.pages.pages_needed(s, 1) for s in seqs) > self.pages.num_free_pages:
            return None
        out = SchedulerOutput()
        for seq in seqs:
            self.pages.allocate(seq, 1)
            out.scheduled.append(ScheduledSeq(seq, 1))
        out.page_copies = self.pages.take_pending_copies()
        return out

    def free_seats(self) -> int:
        return self.max_num_seqs - sum(map(seats, self.running))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        free = self.free_seats()
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats(seq) > free:
                break
            # a request scoring its prompt must compute every prompt token: no cache hits
            scored = seq.request.params.prompt_logprobs is not None
            hits = [] if scored else self.pages.match_prefix(seq)
            computed = len(hits) * self.pages.page_size
            n = min(seq.num_tokens - computed, budget)
            if self.pages.pages_needed(seq, n, hits) > self.pages.num_free_pages:
                break
            self.waiting.popleft()
            self.pages.take_hits(seq, hits, looked_up=not scored)
            self.pages.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            free -= seats(seq)

    def fork_samples(self, sampling: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """Which sequence each sampled token goes to, and the logits row it is drawn from. A
        request's first sample forks its other samples here: they share the prompt's pages
        (copy-on-write) and draw from the same logits row, and run on their own from now on."""
        seqs, rows = [], []
        for row, seq in enumerate(sampling):
            born = [c for c in seq.request.seqs[1:] if c.status == SeqStatus.UNBORN] \
                if seq.sample_index == 0 and seq.num_output_tokens == 0 else []
            for child in born:
                self.pages.fork(seq, child)
                child.status = SeqStatus.RUNNING
            self.running += born
            seqs += [seq, *born]
            rows += [row] * (1 + len(born))
        return seqs, rows

    def accept(self, item: ScheduledSeq, num_emitted: int) -> None:
        """A verify step emitted num_emitted tokens for item's sequence (already committed): its
        cache holds the tokens up to the last accepted draft, and the pages past what its tokens
        need (written only by rejected drafts) go back to the pool."""
        seq = item.seq
        seq.draft_token_ids = []
        if seq.status != SeqStatus.RUNNING:
            return
        seq.num_computed_tokens = item.start + num_emitted
        self.pages.truncate(seq, seq.num_tokens)
        self.pages.register_full_pages(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.pages.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def abort_request(self, req: Request) -> None:
        for seq in req.seqs:
            if seq.status != SeqStatus.FINISHED:
                self.finish(seq, "abort")
