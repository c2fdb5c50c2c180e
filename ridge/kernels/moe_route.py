"""Routing for mixture-of-experts layers (Triton): choose each token's experts, then lay the
(token, expert) pairs out by expert for the grouped GEMM. References: `route_topk_ref`,
`align_by_expert_ref` below.

route_topk: the router's logits [T, E] -> per token the top_k experts of softmax(logits) and their
probabilities (renormalised to sum to 1 or not), in descending order as torch.topk gives them.
One program per token holds its whole row of E logits (E <= a few hundred) in registers: softmax
and k rounds of argmax-and-mask are a few hundred FLOPs, so what the kernel saves is launches -
torch spends a softmax, a topk and a division (three kernels and two [T, E] round trips) on it.
Ties go to the lower expert index, as torch.topk's do.

route_grouped_ref: DeepSeek's router (sigmoid or softmax scores, a score bias, group-limited
choice, a scale), in torch ops on every device for now: a handful of small kernels a layer, no
host sync, so a CUDA graph holds it.

align_by_expert: the T * top_k pairs (pair p = token p // top_k, its (p % top_k)-th choice),
sorted by expert - stable, so a token's pairs keep token order inside an expert - and each
expert's run padded to a multiple of the GEMM tile height BLOCK_M. Every tile of the grouped
GEMM then belongs to one expert and reads that expert's weight tile once for all its rows
(vLLM's moe_align_block_size is the model). Outputs, all of sizes fixed by (T, top_k, E,
BLOCK_M), so a CUDA graph can hold the whole path:
  * pair_order [max_blocks * BLOCK_M]: the pair in each row slot; padding slots hold T * top_k
    (one past the last pair: the GEMM masks those rows),
  * block_expert [max_blocks]: the expert of each tile, -1 past the last used tile,
  * expert_counts [E]: pairs per expert (the roofline's tokens per expert).
Two launches, each a program per chunk of pairs (about one per SM): the first counts its chunk's
pairs per expert; the second scans the totals over experts (padded starts), adds the counts of
the chunks before its own, and places each pair at its start plus its rank inside the chunk (a
one-hot [chunk, E] cumulative sum): the stable order of a sort, without a sort, without atomics
and without a zeroed buffer, so the layout is the same on every run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ridge.kernels.pdl import launch_options, pdl_wait, use_pdl


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, experts [T, top_k] int32): softmax over experts in float32,
    the top_k largest, divided by their sum when `renormalize` (HF's routers)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts.to(torch.int32)


def route_grouped_ref(logits: torch.Tensor, top_k: int, renormalize: bool, routing,
                      score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router (routing: ridge.model_config.GroupedRouting), in float32 as transformers
    runs it: softmax (V2) or sigmoid (V3) scores; V3 adds score_bias to choose (not to weigh);
    the experts of all but the topk_group best of n_group groups (a group's score: its best
    expert's, or its two best summed) are out of the choice; the top_k scores, renormalised if
    asked, times routing.scale. -> (weights [T, top_k] float32, experts [T, top_k] int32)."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    if routing.n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, routing.n_group, E // routing.n_group)
        group_scores = grouped.max(dim=-1).values if routing.group_score == "max" else \
            grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(routing.topk_group, dim=-1).indices, 1)
        outside = (kept == 0)[:, :, None].expand_as(grouped).reshape(T, E)
        # V2 zeroes the scores outside the kept groups, V3 sets them to -inf: the same choice
        # wherever the kept groups hold top_k positive scores (softmax/sigmoid scores are positive)
        choice = choice.masked_fill(outside, 0.0 if routing.scoring == "softmax" else float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale, experts.to(torch.int32)


@triton.jit
def _route_topk_kernel(Logits, Weights, Experts, E, stride_t, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    js = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)       # the logits are the router GEMM's output
    logits = tl.load(Logits + t * stride_t + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(offs < E, p, -1.0)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    experts = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0, tie_break_left=True)
        weights = tl.where(js == j, tl.sum(tl.where(offs == best, left, 0.0), axis=0), weights)
        experts = tl.where(js == j, best.to(tl.int32), experts)
        left = tl.where(offs == best, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(Weights + t * TOP_K + js, weights, mask=js < TOP_K)
    tl.store(Experts + t * TOP_K + js, experts, mask=js < TOP_K)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_topk_ref's result, in one launch."""
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"route_topk: top_k must be in [1, {E}], got {top_k}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        pdl = use_pdl(logits)
        block_e = max(16, triton.next_power_of_2(E))
        _route_topk_kernel[(T,)](logits, weights, experts, E, logits.stride(0), TOP_K=top_k,
                                 BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=block_e, RENORMALIZE=renormalize,
                                 PDL=pdl, num_warps=1 if block_e <= 256 else 4, **launch_options(pdl))
    return weights, experts


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the aligned layout can need: each expert with pairs wastes at most block_m - 1 slots."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_by_expert_ref(experts: torch.Tensor, num_experts: int, block_m: int):
    """(pair_order, block_expert, expert_counts) as the module docstring defines them."""
    flat = experts.reshape(-1).long()
    P = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    nb = max_blocks(P, num_experts, block_m)
    pair_order = torch.full((nb * block_m,), P, dtype=torch.int32, device=experts.device)
    order = torch.sort(flat, stable=True).indices
    first = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    slots = starts[sorted_e] + torch.arange(P, device=flat.device) - first[sorted_e]
    pair_order[slots] = order.to(torch.int32)
    block_expert = torch.full((nb,), -1, dtype=torch.int32, device=experts.device)
    for e in range(num_experts):
        b0, nbe = int(starts[e]) // block_m, int(padded[e]) // block_m
        block_expert[b0:b0 + nbe] = e
    return pair_order, block_expert, counts.to(torch.int32)


@triton.jit
def _align_count_kernel(Experts, Hist, PairOrder, P, num_slots, CHUNK: tl.constexpr, SUB: tl.constexpr,
                        BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Pass 1, a program per CHUNK pairs: its chunk's pairs per expert (a row of Hist), and its share
    of the padding slots filled."""
    c = tl.program_id(0)
    e_offs = tl.arange(0, BLOCK_E)
    s_offs = tl.arange(0, SUB)
    # nothing is written before the wait: under PDL the previous kernel may still be reading
    # memory the allocator has handed to this one
    pdl_wait(PDL)       # the experts are route_topk's output
    share = tl.cdiv(num_slots, tl.num_programs(0))
    for s in range(c * share, (c + 1) * share, SUB):
        tl.store(PairOrder + s + s_offs, P, mask=(s + s_offs < num_slots) & (s + s_offs < (c + 1) * share))
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(c * CHUNK, (c + 1) * CHUNK, SUB):
        ids = tl.load(Experts + s + s_offs, mask=s + s_offs < P, other=-1)
        counts += tl.sum((ids[:, None] == e_offs[None, :]).to(tl.int32), axis=0)
    tl.store(Hist + c * BLOCK_E + e_offs, counts)


@triton.jit
def _align_place_kernel(Experts, Hist, PairOrder, BlockExpert, Counts, P, E, num_chunks, num_blocks,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
                        PDL: tl.constexpr):
    """Pass 2, a program per chunk: every expert's padded start (an exclusive scan of the totals),
    plus the pairs of earlier chunks (the rows of Hist above this one), plus the rank inside the
    chunk (a one-hot cumulative sum) is each pair's slot: the stable order, with no atomics."""
    c = tl.program_id(0)
    e_offs = tl.arange(0, BLOCK_E)
    s_offs = tl.arange(0, SUB)
    pdl_wait(PDL)       # Hist and the padding are pass 1's
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r in range(0, num_chunks):
        row = tl.load(Hist + r * BLOCK_E + e_offs)
        totals += row
        before += tl.where(r < c, row, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    seen = ends - padded + before
    for s in range(c * CHUNK, (c + 1) * CHUNK, SUB):
        ids = tl.load(Experts + s + s_offs, mask=s + s_offs < P, other=-1)
        onehot = (ids[:, None] == e_offs[None, :]).to(tl.int32)
        slot = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + seen[None, :]), axis=1)
        tl.store(PairOrder + slot, (s + s_offs).to(tl.int32), mask=s + s_offs < P)
        seen += tl.sum(onehot, axis=0)
    if c == 0:
        tl.store(Counts + e_offs, totals, mask=e_offs < E)
        for b in range(0, num_blocks, SUB):
            first_slot = (b + s_offs) * BLOCK_M
            owner = tl.sum((ends[None, :] <= first_slot[:, None]).to(tl.int32), axis=1)
            tl.store(BlockExpert + b + s_offs, tl.where(owner < E, owner, -1), mask=b + s_offs < num_blocks)


_ALIGN_PROGRAMS = 128       # about one program per SM: enough to stream the pairs, few Hist rows


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int):
    """align_by_expert_ref's (pair_order, block_expert, expert_counts), in two launches."""
    P = experts.numel()
    nb = max_blocks(P, num_experts, block_m)
    dev = experts.device
    pair_order = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_e = max(16, triton.next_power_of_2(num_experts))
    sub = max(16, min(64, 8192 // block_e))
    chunk = max(sub, triton.next_power_of_2(triton.cdiv(max(P, 1), _ALIGN_PROGRAMS)))
    num_chunks = triton.cdiv(max(P, 1), chunk)
    hist = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)
    pdl = use_pdl(experts)
    flat = experts.reshape(-1)
    warps = 4 if block_e * sub <= 4096 else 8
    _align_count_kernel[(num_chunks,)](flat, hist, pair_order, P, nb * block_m, CHUNK=chunk, SUB=sub, BLOCK_E=block_e,
                                       PDL=pdl, num_warps=warps, **launch_options(pdl))
    _align_place_kernel[(num_chunks,)](flat, hist, pair_order, block_expert, counts, P, num_experts, num_chunks, nb,
                                       BLOCK_M=block_m, CHUNK=chunk, SUB=sub, BLOCK_E=block_e, PDL=pdl, num_warps=warps,
                                       **launch_options(pdl))
    return pair_order, block_expert, counts
