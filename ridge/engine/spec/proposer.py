"""The proposer interface of speculative decoding: what the engine asks of a draft source.

Each step the engine hands a proposer the sequences that speculate and, per sequence, the most
draft tokens it may take (`limits`: num_speculative_tokens, lowered by the room left before
max_tokens and the context length, and by the sequence's measured acceptance). The proposer
returns, per sequence, up to that many token ids, and optionally the distribution each was drawn
from: the target's verification (rejection.py) accepts a draft x with probability
min(1, p(x)/q(x)), and a proposer that returns no distribution is taken to have proposed point
masses (q(x) = 1), which is exact for deterministic guesses such as n-gram lookup.

A sequence as the proposer sees it: `seq_id`, `token_ids` (prompt and output so far; the proposal
continues it), `num_prompt_tokens`, `num_output_tokens`, `seed`, `request.params` (SamplingParams).
A proposer that keeps per-sequence state (a draft model's KV cache) drops it in `release`, called
with the ids of sequences that finished or were preempted.

Under a structured output's grammar a sequence's drafts are cut at the first one the grammar
rejects. That keeps rejection sampling exact for point masses and for a q drawn under the grammar's
masks (`masks_grammar`: the draft model masks q as the target's p is masked); a sampled draw from
an unmasked q, cut, would bias it, so a sampling request under a grammar takes no drafts from a
proposer without `masks_grammar` (greedy ones do: greedy acceptance reads no q).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Proposal:
    tokens: list[list[int]]                 # per sequence, at most its limit (may be empty)
    probs: torch.Tensor | None = None       # [N, max limit, vocab] q at each draft position, or None


class Proposer(Protocol):
    masks_grammar: bool       # its drafts keep rejection sampling exact under a grammar (above)

    def propose(self, seqs: list, limits: list[int]) -> Proposal: ...

    def release(self, seq_ids: set[int]) -> None: ...
