"""Overlapped decode (async scheduling): keep the GPU busy while the host commits tokens.

Reading sampled ids back makes the host wait for the GPU, whose next step then waits for the
host. So a decode step whose rows need nothing from the host but their ids leaves them on the
GPU: token lists get placeholders (PENDING, counted by `Sequence.num_pending`) while ids and
logprob tensors copy to pinned host memory. The next engine step first launches the following
decode step (its input ids gathered on the device), then waits for the earlier ids and commits
them, overlapping the step just launched. A sequence the earlier token stops (stop token or
string) has had one extra token computed, which is discarded; one it ends by length is known and
left out. Penalties read the host's token history, so rows using them run synchronously, as does
any step that must admit, preempt or fork (the regular schedule).

Structured outputs overlap too. A row's mask needs every token before it, so a step with a
grammar row launches only its forward ahead; the engine then waits for the earlier ids, commits
them (the matchers take them) and samples the launched step under the new masks. The host's
wait, commit and mask filling run while the device runs that forward; only the sampler waits
for the masks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.engine.request import Sequence, SeqStatus
from ridge.engine.scheduler import Scheduler, SchedulerOutput, seats

PENDING = -1    # a token id still on the GPU


@dataclass
class InflightStep:
    """A decode step whose sampled ids have not been read back yet."""
    seqs: list[Sequence]              # one per sampled row
    tokens: torch.Tensor              # [rows] int64 on the device: the next step's inputs
    host: torch.Tensor                # their host copy, valid once `done` has completed
    info: tuple | None                # the sampler's logprob tensors, copying to the host likewise
    done: object                      # torch.cuda.Event, or None where the copy is synchronous
    indices: list[int]                # the token_ids index each row's id fills
    sched: SchedulerOutput            # advanced (pages registered) once the ids before it are known


@dataclass
class UnsampledStep:
    """A decode step launched ahead whose rows wait for their masks before they are sampled."""
    seqs: list[Sequence]
    logits: torch.Tensor
    sched: SchedulerOutput


class DecodeOverlap:
    def __init__(self, scheduler: Scheduler, runner, max_model_len: int, sample):
        """`sample(logits, seqs) -> (tokens, info, readback ids)`: the engine's sampler, masks applied."""
        self.scheduler, self.runner, self.max_model_len, self.sample = scheduler, runner, max_model_len, sample
        self.inflight: InflightStep | None = None
        self.num_overlapped_steps = 0     # decode steps launched before the previous step's ids were read

    def leave_on_device(self, seqs: list[Sequence], tokens: torch.Tensor, info, readback: torch.Tensor,
                        sched: SchedulerOutput) -> None:
        """The step's ids stay on the device; a sequence that ended meanwhile (its row was computed
        before its end was known) gets no placeholder, and its id is discarded at commit. `readback`:
        the ids the host reads (ridge.engine.faults.readback_ids: -1 flags non-finite logits)."""
        if info is not None:              # queued before the tokens' copy, whose event then covers them
            info = tuple(t.to("cpu", non_blocking=True) if t is not None else None for t in info)
        host, done = self.runner.tokens_to_host(readback)
        indices = [len(seq.token_ids) for seq in seqs]
        for seq in seqs:
            if not seq.is_finished:
                seq.token_ids.append(PENDING)
                seq.num_pending += 1
        self.inflight = InflightStep(seqs, tokens, host, info, done, indices, sched)

    def launch_ahead(self) -> tuple[InflightStep, UnsampledStep | None]:
        """Take the in-flight step, first launching the next decode step (without the sequences
        the taken step ends by length) if its sequences are all that runs and no waiting request
        could be admitted (which needs the regular schedule). A step launched is sampled at once
        and in flight, or, when a row has a grammar, returned unsampled (`sample_ahead` after the
        taken step's commit)."""
        prev, self.inflight = self.inflight, None
        sched = self.scheduler
        live = [s for s in prev.seqs if s.status == SeqStatus.RUNNING]
        admissible = sched.waiting and seats(sched.waiting[0]) <= sched.free_seats()   # admission's own rule
        if admissible or not live or len(live) != len(sched.running):
            return prev, None
        seqs = [s for s in live if s.num_output_tokens < s.request.max_tokens and s.num_tokens < self.max_model_len]
        step = sched.schedule_decode(seqs) if seqs else None
        if step is None:
            return prev, None
        row = {s.seq_id: i for i, s in enumerate(prev.seqs)}
        fwd = self.runner.execute(step, (prev.tokens, [row[s.seq_id] for s in seqs]))
        self.num_overlapped_steps += 1
        ahead = UnsampledStep(seqs, fwd.logits, step)
        if any(s.grammar is not None for s in seqs):
            return prev, ahead
        self.sample_ahead(ahead)          # queued right behind the forward
        return prev, None

    def sample_ahead(self, ahead: UnsampledStep) -> None:
        self.leave_on_device(ahead.seqs, *self.sample(ahead.logits, ahead.seqs), ahead.sched)
        self.drop_if_ended()

    def drop_if_ended(self) -> None:
        """Forget the in-flight step when every row of it has ended (stopped while it ran, or
        aborted): there is nothing to commit."""
        if self.inflight is not None and all(s.is_finished for s in self.inflight.seqs):
            self.inflight = None
