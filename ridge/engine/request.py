"""Request, Sequence and the outputs handed back to callers.

A Request holds n Sequences (one per sample). Only sample 0 is scheduled for the prompt; when
its prefill completes, the others are forked from it and share its pages (copy-on-write), so
the prompt is computed and stored once. After that every Sequence is scheduled on its own.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ridge.engine.sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """A prompt (plus the tokens asked for) that the context, or the KV cache, cannot hold: a
    ValueError like any bad request, told apart for clients (OpenAI's context_length_exceeded)."""


class SeqStatus(enum.Enum):
    UNBORN = "unborn"        # sample > 0 of a request, waiting for sample 0's prefill to fork from
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """One candidate at one position. `decoded_token` is the text the token contributes mid-text
    (" =" for byte-level "Ġ="), or OpenAI's "bytes:\\xe2\\x80" for a token that is part of a
    UTF-8 character; `token_bytes` are its true bytes, None for a special token (it adds none to
    a text that skips special tokens) or an id the tokenizer lacks."""
    logprob: float
    rank: int
    decoded_token: str | None = None
    token_bytes: bytes | None = None


@dataclass
class Sequence:
    seq_id: int
    request: "Request"
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)   # hash chain of full pages computed so far
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    text: str = ""
    detokenizer: object = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # by position; position 0 has none
    # Trailing entries of token_ids that are placeholders for ids sampled by a step still on the
    # GPU (the engine's overlapped decode); they count as tokens for scheduling and sampling.
    num_pending: int = 0
    # the proposer's guesses for the tokens after token_ids, verified by this step (speculation)
    draft_token_ids: list[int] = field(default_factory=list)
    grammar: object = None      # structured outputs: its matcher (ridge/engine/structured.py), or None
    grammar_after: str | None = None    # the text its grammar waits for (StructuredOutputsParams.start_after)

    output_token_ids = property(lambda self: self.token_ids[self.num_prompt_tokens:])
    num_output_tokens = property(lambda self: len(self.token_ids) - self.num_prompt_tokens)
    num_tokens = property(lambda self: len(self.token_ids))
    is_finished = property(lambda self: self.status == SeqStatus.FINISHED)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding: verify steps with drafts, draft tokens proposed, of which accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    is_finished = property(lambda self: all(s.is_finished for s in self.seqs))


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of a request's life: queue time is
    first_scheduled - arrival, time to first token first_token - arrival."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    # speculative decoding (vLLM's spec_decode names): steps that verified drafts, drafts, accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate = property(lambda self: acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens))
    mean_accepted_length = property(lambda self: mean_accepted_length(self.num_accepted_tokens, self.num_drafts))


def acceptance_rate(accepted: int, proposed: int) -> float | None:
    """Accepted draft tokens over proposed ones (None before any draft)."""
    return accepted / proposed if proposed else None


def mean_accepted_length(accepted: int, drafts: int) -> float | None:
    """Tokens a verify step emitted on average: its accepted drafts plus the target's own token."""
    return 1 + accepted / drafts if drafts else None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # by prompt position (None at 0): the prompt token and the top-k candidates, as in `logprobs`
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None

    @classmethod
    def of(cls, req: Request) -> "RequestOutput":
        # the output ids whose values are on the host (pending placeholders left out)
        outs = [CompletionOutput(s.sample_index, s.text, s.token_ids[s.num_prompt_tokens:s.num_tokens - s.num_pending],
                                 s.finish_reason, list(s.logprobs) if s.logprobs is not None else None)
                for s in req.seqs]
        prompt_lps = req.seqs[0].prompt_logprobs
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), outs, req.is_finished,
                   list(prompt_lps) if prompt_lps is not None else None,
                   RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                  req.finished_time, req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens))
