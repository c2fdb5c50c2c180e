"""Exact speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

A proposer (a small draft model, or n-gram prompt lookup) guesses the next k tokens of a row; the
target model scores all k+1 positions in one forward pass; `verify` keeps the longest prefix the
target agrees with and emits one more token, so a step yields 1..k+1 tokens for the cost of one
target pass. Decode is memory-bound at small batches (the weights are read once per pass whatever
the row count), which is why the extra positions are nearly free there.

Why the output distribution is the target's, exactly. At one position, let q be the distribution
the draft token x was drawn from and p the target's. Accept x with probability min(1, p(x)/q(x));
on rejection draw from r = max(p - q, 0) / sum(max(p - q, 0)). Then
    P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y) = min(p(y), q(y)) + max(p(y) - q(y), 0) = p(y),
because P(reject) = 1 - sum(min(p, q)) = sum(max(p - q, 0)) is exactly r's normaliser. Each
accepted token is therefore a sample of p given its prefix, the verification of the next position
conditions on that prefix, and the bonus token (all k accepted) is a plain sample of p at k: by
induction the emitted sequence is distributed as plain decoding from the target. This holds for
any q, including a point mass (n-gram proposals: accept with probability p(x), else resample p with
x removed); q only sets how often drafts are accepted.

Randomness and determinism. Exactness needs the acceptance uniform, the residual draw and the draft
draw at one position to be independent. They come from three streams of the sampler's counter-based
noise, `uniform_noise(seed ^ stream, output index, token id)`: stream 0 is the plain sampler's (draft
tokens and the bonus token), the other two are salted. A token emitted at output index t depends
only on the streams at index t, so when a round rejects at t the discarded drafts after t leave
no trace in the output, and the next round may draw index t+1's noise afresh without bias. There is
no generator state and no row reads another row, so a seeded request gives the same tokens alone,
in any batch and in any order. Greedy rows never touch noise: they accept while the draft equals
the target's argmax and then emit that argmax, which is plain greedy decoding token for token. A
draft identical to the target, sampled with `sample_probs` at the plain stream, is always accepted
and reproduces the plain sampler's seeded output.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ridge.layers.sampler import SamplingBatch, apply_penalties, filter_probs, uniform_noise

# XOR-ed into the seed's low 32 bits, which enter the noise hash only through a final mix, so the
# salted streams share no (seed, index) input with the plain stream of any row
_ACCEPT_STREAM = 0x5BD1E995
_RESIDUAL_STREAM = 0x27D4EB2F


def _racing(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, stream: int) -> torch.Tensor:
    """argmax(p_i / E_i), E_i ~ Exp(1): token i with probability p_i / sum(p), no cumsum needed."""
    noise = -torch.log(uniform_noise(seeds ^ stream, steps, probs.shape[-1]))
    return (probs / noise).argmax(dim=-1)


def sample_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N, V] probabilities -> [N] tokens with the plain sampler's noise (the stream `sample` uses),
    for drawing draft tokens: a draft equal to the target then reproduces plain sampling."""
    return _racing(probs, seeds, steps, 0)


def _per_position(b: SamplingBatch, context: torch.Tensor | None, n: int, s: int, vocab: int) -> SamplingBatch:
    """The batch for n*s rows (row r's position i at r*s + i). Position i is the output index
    steps + i, and its penalties count the i context tokens before it as output already: the
    target scores position i as if those draft tokens had been emitted, which they have if it
    gets that far."""
    def rep(t):
        return None if t is None else t.repeat_interleave(s, dim=0)
    counts, seen = b.output_counts, b.seen_mask
    if s > 1 and (counts is not None or seen is not None):
        if context is None:
            raise ValueError("draft_tokens: required to apply penalties at more than one position")
        if context.dim() != 2 or context.shape[0] != n or context.shape[1] < s - 1:
            raise ValueError(f"draft_tokens: expected shape [{n}, >= {s - 1}], got {list(context.shape)}")
        toks = context[:, : s - 1].long()
        hit = torch.zeros(n, s - 1, vocab, device=toks.device)
        # negative ids are padding (rows that proposed fewer tokens): they count as nothing
        hit.scatter_(-1, toks.clamp(min=0)[..., None], (toks >= 0).float()[..., None])
        before = torch.cat([torch.zeros_like(hit[:, :1]), hit.cumsum(dim=1)], dim=1)   # [n, s, V]
        if counts is not None:
            counts = (counts[:, None] + before).reshape(n * s, vocab)
        if seen is not None:
            seen = (seen[:, None] | (before > 0)).reshape(n * s, vocab)
    else:
        counts, seen = rep(counts), rep(seen)
    offsets = torch.arange(s, device=b.steps.device)
    return replace(
        b, temperature=rep(b.temperature), top_k=rep(b.top_k), top_p=rep(b.top_p), min_p=rep(b.min_p),
        seeds=rep(b.seeds), steps=(b.steps[:, None] + offsets).reshape(-1),
        presence_penalty=rep(b.presence_penalty), frequency_penalty=rep(b.frequency_penalty),
        repetition_penalty=rep(b.repetition_penalty), output_counts=counts, seen_mask=seen,
        banned=rep(b.banned))


def target_probs(logits: torch.Tensor, batch: SamplingBatch, draft_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The normalised distribution `sample` draws from: penalties, temperature, then top-k / top-p /
    min-p, exactly as `sample` applies them; greedy rows (temperature 0) get a point mass on the
    argmax of the penalised logits, the token `sample` would pick.

    logits [N, V] -> [N, V], or [N, S, V] -> [N, S, V] for S consecutive positions of each row,
    where position i follows draft_tokens[:, :i] (needed only when the batch carries penalties).
    Normalising matters here and not in `sample`: the acceptance ratio p(x)/q(x) compares masses,
    while the race's argmax does not care about scale."""
    if logits.dim() == 2:
        flat, b, shape = logits, batch, logits.shape
    elif logits.dim() == 3:
        n, s, vocab = logits.shape
        if batch.temperature.shape[0] != n:
            raise ValueError(f"logits: {n} rows but the batch has {batch.temperature.shape[0]}")
        flat, b, shape = logits.reshape(n * s, vocab), _per_position(batch, draft_tokens, n, s, vocab), logits.shape
    else:
        raise ValueError(f"logits: expected [N, V] or [N, S, V], got {list(logits.shape)}")
    if b.temperature.shape[0] != flat.shape[0]:
        raise ValueError(f"logits: {flat.shape[0]} rows but the batch has {b.temperature.shape[0]}")
    flat = apply_penalties(flat.float(), b)
    greedy = b.temperature == 0
    probs = torch.zeros_like(flat).scatter_(-1, flat.argmax(dim=-1, keepdim=True), 1.0)
    if not (batch.all_greedy if batch.all_greedy is not None else bool(greedy.all())):
        temp = torch.where(greedy, torch.ones_like(b.temperature), b.temperature)
        sampled = filter_probs(torch.softmax(flat / temp[:, None], dim=-1), b)
        sampled = sampled / sampled.sum(dim=-1, keepdim=True)
        probs = torch.where(greedy[:, None], probs, sampled)
    return probs.reshape(shape)


# the draft's distribution is computed the same way: q may be anything, but the closer it is to p
# (same penalties, temperature and filters) the more drafts the target accepts
draft_probs = target_probs


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected shape {list(shape)}, got {got}")


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           seeds: torch.Tensor, first_step: torch.Tensor, greedy: torch.Tensor,
           num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft and emit one more token.

    draft_tokens [N, k] int; draft_probs [N, k, V] (q at each draft position) or None for
    point-mass proposals (n-gram); target_probs [N, k+1, V] (p, normalised, e.g. `target_probs`);
    seeds [N]; first_step [N] the output index of the first draft position; greedy [N] bool;
    num_draft [N] how many of the k drafts each row really proposed (default k; 0 is plain
    sampling). Values are clamped to [0, k] rather than checked: reading them would stall the host.

    Returns (tokens [N, k+1] int64, the emitted tokens left-aligned and padded with -1,
    num_emitted [N] = accepted drafts + the bonus or resampled token, 1..num_draft+1). Runs on
    the device without a host sync; loops over nothing."""
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens: expected [N, k], got {getattr(draft_tokens, 'shape', draft_tokens)}")
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens: expected integer token ids, got {draft_tokens.dtype}")
    n, k = draft_tokens.shape
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs: expected [{n}, {k + 1}, V], got {getattr(target_probs, 'shape', None)}")
    vocab = target_probs.shape[-1]
    _check("target_probs", target_probs, (n, k + 1, vocab))
    if draft_probs is not None:
        _check("draft_probs", draft_probs, (n, k, vocab))
    for name, t in (("seeds", seeds), ("first_step", first_step), ("greedy", greedy)):
        _check(name, t, (n,))
    if num_draft is not None:
        _check("num_draft", num_draft, (n,))
    dev = target_probs.device
    rows = torch.arange(n, device=dev)
    drafts = draft_tokens.long()
    seeds, first_step, greedy = seeds.long(), first_step.long(), greedy.bool()
    proposed = torch.full((n,), k, device=dev) if num_draft is None else num_draft.long().clamp(0, k)
    pos = torch.arange(k + 1, device=dev)
    steps = first_step[:, None] + pos                                    # [N, k+1] output indices
    best = target_probs.argmax(dim=-1)                                   # [N, k+1]
    safe = drafts.clamp(0, vocab - 1)                                    # padding may be -1

    # every position's verdict at once; the leading run of acceptances is what counts
    p_x = target_probs[:, :k].gather(-1, safe[..., None]).squeeze(-1)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, safe[..., None]).squeeze(-1)
    u = uniform_noise(seeds[:, None].expand(n, k).reshape(-1) ^ _ACCEPT_STREAM, steps[:, :k].reshape(-1), 1)
    # u < p/q without the division: q(x) = 0 (x impossible under q) accepts iff p(x) > 0
    ok = torch.where(greedy[:, None], drafts == best[:, :k], u.view(n, k) * q_x < p_x)
    ok &= (pos[None, :k] < proposed[:, None]) & (drafts >= 0)
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)                     # [N] in 0..num_draft

    j = accepted
    p_j = target_probs[rows, j]                                          # [N, V]
    rejected = j < proposed
    if k > 0:
        jq = j.clamp(max=k - 1)
        if draft_probs is None:   # max(p - onehot(x), 0) is p with x removed
            residual = p_j.scatter(-1, safe[rows, jq][:, None], 0.0)
        else:
            residual = (p_j - draft_probs[rows, jq].to(p_j.dtype)).clamp(min=0)
        # rounding can reject where p == q, leaving no residual mass: p itself is then the answer
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_j)
        final_p = torch.where(rejected[:, None], residual, p_j)
        noise_seeds = torch.where(rejected, seeds ^ _RESIDUAL_STREAM, seeds)
    else:
        final_p, noise_seeds = p_j, seeds
    last = _racing(final_p, noise_seeds, first_step + j, 0)
    last = torch.where(greedy, best[rows, j], last)

    tokens = torch.where(pos[None, :k] < j[:, None], drafts, -1)
    tokens = torch.cat([tokens, torch.full((n, 1), -1, device=dev, dtype=torch.long)], dim=1)
    tokens[rows, j] = last
    return tokens, j + 1
