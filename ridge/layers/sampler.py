"""Token sampling for a batch of rows, each with its own parameters. Randomness is counter-based:
the uniform number for (row seed, output index, token id) is a hash of the three, so a seeded
request draws the same numbers alone, in a batch or after a preemption, on the CPU or the GPU, and
no generator state lives anywhere. Sampling is the exponential race: argmax(p_i / E_i), E_i ~
Exp(1), picks token i with probability p_i exactly, in one pass and without a cumulative sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.layers.cost import OpCost, StepShape

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 uniforms in (0, 1), a pure function of (seed, step, token id)."""
    row = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) + steps * 0x9E3779B1) & _MASK32))
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32((row[:, None] + idx * 0x85EBCA77) & _MASK32)
    # 23 bits, so (k + 0.5) / 2^23 is exact in float32 and never rounds to 0 or 1 (-log(1) = 0
    # would make a token win every race)
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors on the logits' device."""
    temperature: torch.Tensor      # [N] float32, 0 = greedy
    top_k: torch.Tensor            # [N] int64, vocab = off
    top_p: torch.Tensor            # [N] float32
    min_p: torch.Tensor            # [N] float32
    seeds: torch.Tensor            # [N] int64
    steps: torch.Tensor            # [N] int64: index of the token being sampled in its sequence's output
    presence_penalty: torch.Tensor     # [N] float32
    frequency_penalty: torch.Tensor    # [N] float32
    repetition_penalty: torch.Tensor   # [N] float32
    output_counts: torch.Tensor | None  # [N, V] float32 counts of output tokens (None: no penalties)
    seen_mask: torch.Tensor | None      # [N, V] bool: token in prompt or output (repetition penalty)
    banned: torch.Tensor | None         # [N, V] bool: tokens not allowed yet (min_tokens)
    max_logprobs: int                   # 0: no row wants logprobs
    all_greedy: bool | None = None      # known on the host (None: read it from `temperature`)


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.seen_mask is not None:
        rp = b.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(b.seen_mask, penalised, logits)
    if b.output_counts is not None:
        logits = logits - b.frequency_penalty[:, None] * b.output_counts
        logits = logits - b.presence_penalty[:, None] * (b.output_counts > 0).float()
    if b.banned is not None:
        # min_tokens bans the stop tokens, except in a row where they are all that is left: a
        # structured output's grammar at its end allows only them, and there the grammar wins (the
        # output is complete; a row of nothing but -inf has no token to draw)
        banned = logits.masked_fill(b.banned, float("-inf"))
        logits = torch.where((banned > float("-inf")).any(dim=-1, keepdim=True), banned, logits)
    return logits


def filter_probs(probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Zero out tokens outside top-k, outside the top-p nucleus, or below min_p * max prob."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = rank >= b.top_k[:, None]
    # keep the smallest prefix whose mass reaches top_p (the first token always stays); top_p = 1
    # keeps everything: in float32 the mass before a far-tail token can round to 1; a top_p below
    # float32's least (5e-324, valid) reads as 0 and still keeps the first
    drop |= ((sorted_p.cumsum(-1) - sorted_p) >= b.top_p[:, None]) & (b.top_p[:, None] < 1) & (rank > 0)
    drop |= sorted_p < b.min_p[:, None] * sorted_p[:, :1]
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))


def sample(logits: torch.Tensor, b: SamplingBatch):
    """logits [N, V] float32 -> (token ids [N], logprob info or None). Logprobs are of the raw
    distribution (before penalties and temperature), as vLLM reports them: for each row, the
    sampled token's log-probability and rank, and the top-k."""
    raw, logits = logits, apply_penalties(logits, b)
    greedy = b.temperature == 0
    tokens = logits.argmax(dim=-1)
    # the host knows whether every row is greedy; asking the device would stall the host until
    # the forward pass finishes, and then nothing overlaps with the GPU
    all_greedy = b.all_greedy if b.all_greedy is not None else bool(greedy.all())
    if not all_greedy:
        temp = torch.where(greedy, torch.ones_like(b.temperature), b.temperature)
        probs = filter_probs(torch.softmax(logits / temp[:, None], dim=-1), b)
        noise = -torch.log(uniform_noise(b.seeds, b.steps, logits.shape[-1]))
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, (logprob_info(raw, tokens, b.max_logprobs) if b.max_logprobs >= 0 else None)


def logprob_info(raw: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple:
    """(the tokens' log-probabilities under the raw logits [N, V], their ranks, the top-`top`
    values and ids, or None, None for top = 0)."""
    logp = torch.log_softmax(raw, dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    rank = (logp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = logp.topk(top, dim=-1) if top else (None, None)
    return chosen, rank, top_v, top_i


def info_on_host(info: tuple | None) -> tuple | None:
    """logprob_info's tensors copied to the host (None stays None), for committing."""
    return tuple(t.cpu() if t is not None else None for t in info) if info is not None else None


def sampling_cost(step: StepShape, vocab: int) -> OpCost:
    """Reads the float32 logits once. Greedy: one comparison a logit; random: 10 FLOPs a logit
    (temperature, softmax's max/subtract/exp/sum/divide, -log of the noise, divide by it, argmax)."""
    n = step.sampled_rows * vocab
    return OpCost("sampling", "sampling", n * (1 if step.greedy else 10), n * 4, compute="fp32", module="sampler")
