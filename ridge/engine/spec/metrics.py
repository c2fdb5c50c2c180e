"""Speculative decoding's counters, vLLM's spec_decode names: what the server exports
(vllm:spec_decode_*), `ridge bench` reports and EngineStats carries. Each verify step of a sequence
with drafts counts once, with the drafts proposed and how many the target accepted, in the
engine's totals and in the request's own (its RequestOutput's metrics). The engine's totals also
count the accepted drafts by position (vLLM's num_accepted_tokens_per_pos: position i counts the
verify steps whose first i + 1 drafts were accepted) and the host time its proposer took (the draft
cost: a draft model's steps, a suffix tree's lookups), under the proposer's method."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    method: str = ""                # the proposer: "ngram", "suffix", "draft_model"
    num_drafts: int = 0             # verify steps of a sequence with drafts
    num_draft_tokens: int = 0       # draft tokens proposed
    num_accepted_tokens: int = 0    # of those, accepted by the target
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: steps that accepted draft i
    propose_seconds: float = 0.0    # host time in the proposer, its draft cost

    def totals(self) -> tuple:
        """EngineStats' spec_* fields, in order."""
        return (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_pos),
                self.propose_seconds, self.method)


def record(counters: SpecCounters, request, drafted: int, accepted: int) -> None:
    """One verify step of a request's sequence: into the engine's totals and the request's own."""
    for c in (counters, request):
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
    per_pos = counters.accepted_per_pos
    per_pos.extend([0] * (accepted - len(per_pos)))
    for i in range(accepted):
        per_pos[i] += 1
