"""Speculative decoding's counters, vLLM's spec_decode names: what the server exports
(vllm:spec_decode_*), `ridge bench` reports and EngineStats carries. Each verify step of a sequence
with drafts counts once, with the drafts proposed and how many the target accepted, in the
engine's totals and in the request's own (its RequestOutput's metrics)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecCounters:
    num_drafts: int = 0             # verify steps of a sequence with drafts
    num_draft_tokens: int = 0       # draft tokens proposed
    num_accepted_tokens: int = 0    # of those, accepted by the target

    def totals(self) -> tuple[int, int, int]:
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens


def record(counters, request, drafted: int, accepted: int) -> None:
    """One verify step of a request's sequence: into the engine's totals and the request's own."""
    for c in (counters, request):
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
