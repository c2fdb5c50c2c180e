"""The sampler's per-row parameters of a batch of sequences (SamplingBatch), as the runner builds
them for the plain sampler and speculation's verification and drafts: each field one host list
moved to the device in one copy (`to_dev`: the runner's pinned, non-blocking copy); the penalty
counts and the min_tokens ban as [rows, vocab] masks scattered on the device."""
from __future__ import annotations

import torch

from ridge.layers.sampler import SamplingBatch


def sampling_batch(seqs: list, vocab: int, eos_ids: list[int], to_dev, device: torch.device) -> SamplingBatch:
    """Per-row parameters as device tensors. Every host->device copy goes through pinned
    memory without blocking, so building the batch never waits for the GPU."""
    ps, n = [s.request.params for s in seqs], len(seqs)

    def scatter_mask(pairs: list[tuple[int, int]]) -> torch.Tensor:
        """[n, vocab] float32 with 1 at (row, token) for each pair (repeats add up)."""
        t = torch.zeros(n * vocab, dtype=torch.float32, device=device)
        if pairs:
            flat = to_dev([r * vocab + tok for r, tok in pairs], torch.int64)
            t.index_add_(0, flat, torch.ones(len(pairs), dtype=torch.float32, device=device))
        return t.view(n, vocab)

    wants_penalty = any(p.presence_penalty or p.frequency_penalty for p in ps)
    wants_repetition = any(p.repetition_penalty != 1.0 for p in ps)
    counts = seen = banned = None
    if wants_penalty or wants_repetition:
        counts = scatter_mask([(i, t) for i, s in enumerate(seqs) for t in s.output_token_ids])
    if wants_repetition:
        prompt = scatter_mask([(i, t) for i, s in enumerate(seqs) for t in s.token_ids[:s.num_prompt_tokens]])
        seen = (counts > 0) | (prompt > 0)
    ban = [(i, t) for i, (s, p) in enumerate(zip(seqs, ps)) if s.num_output_tokens < p.min_tokens
           for t in (p.stop_token_ids or []) + ([] if p.ignore_eos else eos_ids) if t < vocab]
    if ban:
        banned = scatter_mask(ban) > 0
    f32 = {k: to_dev([getattr(p, k) for p in ps], torch.float32) for k in (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
    i64 = {"top_k": [p.top_k if p.top_k > 0 else vocab for p in ps], "seeds": [s.seed for s in seqs],
           "steps": [s.num_output_tokens for s in seqs]}
    return SamplingBatch(
        **f32, **{k: to_dev(v, torch.int64) for k, v in i64.items()},
        output_counts=counts if wants_penalty else None, seen_mask=seen, banned=banned,
        max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        all_greedy=all(p.temperature == 0 for p in ps))
