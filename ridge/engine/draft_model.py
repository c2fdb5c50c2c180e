"""The draft-model proposer: a small model with the target's vocabulary, run by a runner of its own
(its own paged KV pool, page allocator and decode CUDA graphs) beside the target's.

Per target sequence it keeps a DraftSeq, the draft model's view: the tokens it last saw and the
cache it computed for them. A proposal first brings that cache up to the sequence's current
tokens (the tokens the target accepted since; a rejected draft's cache entries are dropped by
cutting the cache back to the longest prefix both agree on), in one batched chunk that samples
the first draft, then runs one decode step per further draft, all speculating sequences batched.
Each draft is drawn from q, the draft's distribution under the request's own sampling parameters
(spec_sampling.draft_probs), with the plain sampler's noise at that output index, and q is handed to
the verification: a draft identical to the target is then always accepted. A sequence the draft
pool has no pages for gets no drafts this step (the target decodes it plainly).
"""
from __future__ import annotations

import dataclasses

import torch

from ridge.config import EngineConfig, ModelConfig, SpeculativeConfig, model_dir
from ridge.engine.pages import PageAllocator
from ridge.engine.scheduler import ScheduledSeq, SchedulerOutput
from ridge.layers.spec_sampling import draft_probs, sample_probs
from ridge.spec.proposer import Proposal


def draft_config(cfg: EngineConfig, spec: SpeculativeConfig) -> tuple[EngineConfig, ModelConfig]:
    """The draft model's settings (the target's resolved ones, for the draft checkpoint, unquantized)
    and its ModelConfig; the draft must cover the target's context length."""
    path = model_dir(spec.model)
    draft_model_cfg = ModelConfig.from_dir(path)
    if draft_model_cfg.max_position_embeddings < cfg.max_model_len:
        raise ValueError(f"speculative_config: the draft model's context ({draft_model_cfg.max_position_embeddings}) "
                         f"is shorter than max_model_len ({cfg.max_model_len})")
    return dataclasses.replace(cfg, model=path, quantization=None, speculative_config=None), draft_model_cfg


class DraftSeq:
    """What the page allocator and the runner read of a sequence, for the draft model's cache."""

    def __init__(self, seq):
        self.seq_id, self.request, self.seed, self.num_prompt_tokens = seq.seq_id, seq.request, seq.seed, \
            seq.num_prompt_tokens
        self.token_ids: list[int] = []
        self.num_seen = 0                    # tokens of the target sequence when last proposed for
        self.page_table: list[int] = []
        self.page_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.prompt_logprobs = None
        self.draft_token_ids: list[int] = []

    num_tokens = property(lambda self: len(self.token_ids))
    num_output_tokens = property(lambda self: len(self.token_ids) - self.num_prompt_tokens)
    output_token_ids = property(lambda self: self.token_ids[self.num_prompt_tokens:])

    def sync(self, token_ids: list[int]) -> None:
        """Take the target's tokens; keep the cache of the prefix they share with what was seen."""
        keep = min(self.num_computed_tokens, len(token_ids))
        for i in range(min(self.num_seen, keep), keep):    # only tokens after the last sync may differ
            if self.token_ids[i] != token_ids[i]:
                keep = i
                break
        self.num_computed_tokens, self.token_ids, self.num_seen = keep, list(token_ids), len(token_ids)


class DraftModelProposer:
    def __init__(self, runner, eos_ids: list[int]):
        self.runner, self.eos_ids = runner, eos_ids
        self.pages: PageAllocator | None = None
        self.states: dict[int, DraftSeq] = {}

    def allocate(self, num_pages: int, use_graphs: bool) -> None:
        """The draft's KV pool (as many pages as the target's) and its decode path."""
        r = self.runner
        r.allocate_kv_cache(num_pages)
        r.warm_up_prefill()
        r.setup_decode(use_graphs=use_graphs)
        self.pages = PageAllocator(num_pages, r.cfg.page_size, enable_prefix_caching=False)

    def release(self, seq_ids: set[int]) -> None:
        for i in seq_ids:
            state = self.states.pop(i, None)
            if state is not None:
                self.pages.free(state)

    @torch.inference_mode()
    def propose(self, seqs: list, limits: list[int]) -> Proposal:
        states = []
        for seq in seqs:
            state = self.states.setdefault(seq.seq_id, DraftSeq(seq))
            state.sync(seq.token_ids)
            states.append(state)
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
            batch = self.runner.sampling_batch(drafted, vocab, self.eos_ids)
            q = draft_probs(fwd.logits, batch)
            tokens = sample_probs(q, batch.seeds, batch.steps)
            index = torch.tensor([r for r, _ in items], device=q.device)
            probs[index, j] = q
            rows = []
            for (r, _), tok in zip(items, tokens.tolist()):
                out[r].append(tok)
                states[r].token_ids.append(tok)
                rows.append(r)
        return Proposal(out, probs)
