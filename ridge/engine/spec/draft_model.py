"""The draft-model proposer: a small model with the target's vocabulary, run by a runner of its own
(its own paged KV pool, page allocator and decode CUDA graphs) beside the target's.

Per target sequence it keeps a Sequence of its own, the draft model's view: the tokens it last saw
and its pages in the draft pool, with the cache it computed for them. A proposal first brings that cache up to the sequence's current
tokens (the tokens the target accepted since; a rejected draft's cache entries are dropped by
cutting the cache back to the longest prefix both agree on), in one batched chunk that samples
the first draft, then runs one decode step per further draft, all speculating sequences batched.
Each draft is drawn from q, the draft's distribution under the request's own sampling parameters
(rejection.draft_probs), with the plain sampler's noise at that output index, and q is handed to
the verification: a draft identical to the target is then always accepted. Under a structured
output's grammar q is masked as the target's p is (propose). A sequence the draft pool has no pages
for gets no drafts this step (the target decodes it plainly).
"""
from __future__ import annotations

import dataclasses

import torch

from ridge.config import EngineConfig, ModelConfig, SpeculativeConfig, model_dir
from ridge.engine.pages import PageAllocator
from ridge.engine.request import Sequence
from ridge.engine.scheduler import ScheduledSeq, SchedulerOutput
from ridge.engine.spec.rejection import draft_probs, sample_probs
from ridge.engine.spec.proposer import Proposal


def draft_config(cfg: EngineConfig, spec: SpeculativeConfig) -> tuple[EngineConfig, ModelConfig]:
    """The draft model's settings (the target's resolved ones, for the draft checkpoint, unquantized)
    and its ModelConfig; the draft must cover the target's context length."""
    path = model_dir(spec.model)
    draft_model_cfg = ModelConfig.from_dir(path)
    if draft_model_cfg.max_position_embeddings < cfg.max_model_len:
        raise ValueError(f"speculative_config: the draft model's context ({draft_model_cfg.max_position_embeddings}) "
                         f"is shorter than max_model_len ({cfg.max_model_len})")
    return dataclasses.replace(cfg, model=path, quantization=None, speculative_config=None), draft_model_cfg


class DraftModelProposer:
    masks_grammar = True     # q is drawn under the grammar's masks

    def __init__(self, runner, eos_ids: list[int]):
        self.runner, self.eos_ids = runner, eos_ids
        self.pages: PageAllocator | None = None
        self.grammars = None                        # the engine's (attach): q's masks
        self.states: dict[int, Sequence] = {}       # target seq_id -> the draft model's sequence
        self.seen: dict[int, int] = {}              # target seq_id -> its length when last proposed for

    def allocate(self, num_pages: int, use_graphs: bool) -> None:
        """The draft's KV pool (as many pages as the target's) and its decode path."""
        r = self.runner
        r.allocate_kv_cache(num_pages)
        r.warm_up_prefill()
        r.setup_decode(use_graphs=use_graphs)
        self.pages = PageAllocator(num_pages, r.cfg.page_size, enable_prefix_caching=False)

    def attach(self, pages, grammars) -> None:
        """The engine's Grammars (None without a tokenizer); the target's pages are not the draft's."""
        self.grammars = grammars

    def release(self, seq_ids: set[int]) -> None:
        for i in seq_ids:
            state = self.states.pop(i, None)
            self.seen.pop(i, None)
            if state is not None:
                self.pages.free(state)

    def _sync(self, seq) -> Sequence:
        """The draft's sequence for `seq`, taking its tokens and keeping the cache of the prefix they
        share with what was computed (only tokens after the last proposal may differ)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = Sequence(seq.seq_id, seq.request, seq.sample_index, [],
                                                       seq.num_prompt_tokens, seq.seed)
        keep = min(state.num_computed_tokens, seq.num_tokens)
        for i in range(min(self.seen.get(seq.seq_id, 0), keep), keep):
            if state.token_ids[i] != seq.token_ids[i]:
                keep = i
                break
        state.num_computed_tokens, state.token_ids = keep, list(seq.token_ids)
        self.seen[seq.seq_id] = seq.num_tokens
        return state

    @torch.inference_mode()
    def propose(self, seqs: list, limits: list[int]) -> Proposal:
        """Under a grammar, each draft is drawn from q masked by the grammar's state after the
        drafts before it (the sequence's matcher walks them and is rolled back at the end), the
        mask the verification puts on p at that position: every draft is one the grammar allows
        (speculator.verify says why q must be masked rather than its drafts cut), and a sequence
        whose grammar a draft ends drafts no further."""
        grammars = [seq.grammar for seq in seqs]
        walked = [0] * len(seqs)
        try:
            return self._propose(seqs, limits, grammars, walked)
        finally:
            for g, n in zip(grammars, walked):
                if n:
                    g.rollback(n)

    def _propose(self, seqs: list, limits: list[int], grammars: list, walked: list[int]) -> Proposal:
        states = [self._sync(seq) for seq in seqs]
        k, vocab = max(limits), self.runner.model_cfg.vocab_size
        probs = torch.zeros(len(seqs), k, vocab, device=self.runner.device)
        out: list[list[int]] = [[] for _ in seqs]
        rows = list(range(len(seqs)))
        for j in range(k):
            items = []
            for r in rows:
                state = states[r]
                n = state.num_tokens - state.num_computed_tokens
                if limits[r] <= j or self.pages.pages_needed(state, n) > self.pages.num_free_pages:
                    continue
                self.pages.allocate(state, n)
                items.append((r, ScheduledSeq(state, n)))
            if not items:
                break
            fwd = self.runner.execute(SchedulerOutput([item for _, item in items]))
            drafted = [item.seq for _, item in items]
            for _, item in items:
                item.seq.num_computed_tokens += item.num_new_tokens
            if self.grammars is not None:
                self.grammars.mask_matchers(fwd.logits, [grammars[r] for r, _ in items])
            batch = self.runner.sampling_batch(drafted, vocab, self.eos_ids)
            q = draft_probs(fwd.logits, batch)
            tokens = sample_probs(q, batch.seeds, batch.steps)
            index = torch.tensor([r for r, _ in items], device=q.device)
            probs[index, j] = q
            rows = []
            for (r, _), tok in zip(items, tokens.tolist()):
                g = grammars[r]
                if g is not None:
                    if not g.accept_token(tok):
                        continue                # outside the mask (no token allowed): no draft here
                    walked[r] += 1
                out[r].append(tok)
                states[r].token_ids.append(tok)
                if g is None or not g.is_terminated():
                    rows.append(r)
        return Proposal(out, probs)
