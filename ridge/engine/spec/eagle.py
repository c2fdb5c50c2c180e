"""The head proposer, for EAGLE-3 (method "eagle3") and DeepSeek-V3's MTP layer ("mtp"): drafts
from a one-layer head (ridge/models/eagle3.py, ridge/models/mtp.py; their common interface:
ridge/models/draft_head.py) that reads the target's own hidden states, on a runner of its own (its
KV pool, decode path) beside the target's.

Where the states come from. The target's runner captures, in every forward, the states the head
reads (`capture_ids`: EAGLE-3's, the residual stream entering three of its layers; MTP's, the
final normed state) into a buffer it owns (ModelRunner.capture_hidden; set up only for this
proposer, so other engines pay nothing) and calls `record` (its hidden sink) right after the
forward, before anything can overwrite the buffer: every target step passes through it, the
overlapped decode steps included. `record` fuses the step's rows (EAGLE-3's fc, one GEMM; MTP's
are taken as they are) and keeps them, per sequence, as the `stash` of states whose head entries
are not written yet.

The head's cache. Its KV pool has as many pages as the target's and uses the target's page
numbers (the sequence's own page table): no allocator of its own, preemption, prefix hits and
forks are the target's. Row p of the head needs the target's state at p and the token at p + 1,
and its cache entry depends on nothing else (one layer), so `record` writes the entries of every
row whose next token is known as soon as the state arrives (`write_kv`: no attention): when a
page is complete and hashed for prefix caching, the head's entries in the page before it are
too. That is why a prefix hit must drop its last page (PageAllocator.recompute_last_hit): its
last entry was written from the token after it, which the new request may not share. Rows whose
next token is a draft being verified are written tentatively (`fed`) and kept if the draft was
accepted (`_settle` compares them with the sequence's tokens); the next token of the last row is
only known after sampling, so that row waits, its state stashed.

A proposal (k drafts): step 0 runs the waiting row v - 1 (v: the computed tokens) with the
sequence's last token through the whole layer: its logits give draft 1 and its output `pre`
replaces the target's state in step 1, at position v with draft 1 as the token, and so on: k
decode-shaped steps of one row per sequence, through the head runner's decode graphs where it
has them (static buffers: graph-friendly) or eagerly (the torch backend). Those chained entries
at positions >= v are transient: the next record rewrites them from the target's states. Pages
for them are reserved on the target's table first (PageAllocator.reserve, copies made at once in
both pools); a sequence the pool has no room for gets fewer drafts, or none. Each draft is drawn
from q (rejection.draft_probs, the request's sampling parameters) with the plain sampler's noise
at its output index and q goes to the verification, as DraftModelProposer does: exact for any
head, and greedy requests take the argmax.

Left for a GPU: capturing the k steps as one graph (each step is a replay now, with a host
round of staging between), and per-sequence host work (the stash is a tensor per sequence: a
slot buffer indexed by sequence would make record one gather).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ridge.config import EngineConfig, ModelConfig, SpeculativeConfig, model_dir
from ridge.engine.pages import PageAllocator
from ridge.engine.request import Sequence, SeqStatus
from ridge.engine.spec.proposer import Proposal
from ridge.engine.spec.rejection import draft_probs, sample_probs
from ridge.runner.cuda_graphs import DecodeInputs
from ridge.runner.model_runner import plain_greedy, slot_of


def head_config(cfg: EngineConfig, spec: SpeculativeConfig, target: ModelConfig) -> tuple[EngineConfig, ModelConfig]:
    """The head's runner settings and its ModelConfig. EAGLE-3: the target's settings for the head's
    checkpoint, unquantized; unlike a draft model the head's max_position_embeddings may be shorter
    than max_model_len (public heads ship 2048): its rotary tables are built for max_model_len.
    MTP: the target's own settings and checkpoint (quantized as the target is), one layer of it."""
    if spec.method == "mtp":
        return dataclasses.replace(cfg, speculative_config=None), target.mtp_head()
    path = model_dir(spec.model)
    return dataclasses.replace(cfg, model=path, quantization=None, speculative_config=None), ModelConfig.from_dir(path)


@dataclass
class HeadState:
    """The head's view of one target sequence: positions < kv_len hold its entries for the
    sequence's own tokens; rows kv_len.. were written with the next tokens `fed` (drafts under
    verification); `stash` [m, H] holds the fused target states of positions stash_start.."""
    seq: Sequence
    kv_len: int
    fed: list[int] = field(default_factory=list)
    stash_start: int = 0
    stash: torch.Tensor | None = None

    stash_end = property(lambda self: self.stash_start + (0 if self.stash is None else self.stash.shape[0]))

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.stash[lo - self.stash_start:hi - self.stash_start]

    def keep(self, lo: int, hi: int) -> None:
        """Keep the states of [lo, hi) only (a copy: a slice would hold a whole step's rows)."""
        self.stash = self.rows(lo, hi).clone() if hi > lo else None
        self.stash_start = lo


def known_tokens(seq, drafts: list[int], lo: int, hi: int) -> list[int]:
    """The sequence's tokens at positions [lo, hi), its drafts after its last token, up to the
    first one not known on the host (a placeholder of a step still on the device)."""
    known = seq.num_tokens - seq.num_pending
    out = seq.token_ids[lo:min(hi, known)]
    if known == seq.num_tokens and hi > known and lo + len(out) >= known:
        out = out + drafts[max(0, lo - known):hi - known]
    return out


class HeadProposer:
    masks_grammar = False    # q is drawn on the device without the grammar's masks (Proposer)

    def __init__(self, runner, target_runner, eos_ids: list[int], num_speculative_tokens: int):
        """runner: the head's (ModelRunner on the head's checkpoint); target_runner: the target's, before
        its start() (the capture buffer is allocated before the KV budget is measured and captured
        by its graphs)."""
        self.runner, self.target, self.eos_ids = runner, target_runner, eos_ids
        self.head = runner.model
        self.head.share_embedding(target_runner.model.model.embed_tokens)
        cfg = runner.cfg
        ids = self.head.capture_ids(target_runner.model_cfg)
        target_runner.capture_hidden(ids, max(cfg.max_num_batched_tokens, cfg.max_num_seqs * (num_speculative_tokens + 1)))
        self.head.allocate_hidden(cfg.max_num_seqs)        # draft steps: one row a sequence
        target_runner.hidden_sink = self.record
        self.pages: PageAllocator | None = None             # the target's (attach)
        self.states: dict[int, HeadState] = {}

    def allocate(self, num_pages: int, use_graphs: bool) -> None:
        """The head's KV pool (the target's page count) and its decode path. No prefill warm-up:
        the head never runs a prefill-shaped forward (catching up only writes entries)."""
        self.runner.allocate_kv_cache(num_pages)
        self.runner.setup_decode(use_graphs=use_graphs)

    def attach(self, pages: PageAllocator, grammars) -> None:
        """The target's page allocator (the engine's), whose page numbers the head's pool mirrors
        (the head's q is not masked by grammars: masks_grammar)."""
        self.pages = pages
        pages.recompute_last_hit = True

    def release(self, seq_ids: set[int]) -> None:
        for i in seq_ids:
            self.states.pop(i, None)

    # ---- the head's cache, kept up with the target --------------------------------------------

    def _settle(self, seq, cap: int | None = None) -> HeadState:
        """The sequence's state, its tentative rows judged against its tokens now and its stash cut
        to the target's valid states [kv_len, num_computed_tokens); `cap`: rows from here on are
        to be (re)written. A state missing a stretch of states (never expected) restarts at
        num_computed_tokens: the head's entries before it are then stale, which costs acceptance,
        never correctness (the target verifies)."""
        v = seq.num_computed_tokens
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = HeadState(seq, v, stash_start=v)
        if st.fed:
            ok = known_tokens(seq, [], st.kv_len + 1, st.kv_len + 1 + len(st.fed))
            st.kv_len += next((i for i, (a, b) in enumerate(zip(st.fed, ok)) if a != b), min(len(ok), len(st.fed)))
            st.fed = []
        st.kv_len = min(st.kv_len, v, v if cap is None else cap)
        if st.stash_start > st.kv_len or st.stash_end < v:
            st.kv_len, st.stash_start, st.stash = v, v, None
        else:
            st.keep(st.kv_len, v)
        return st

    def _mirror(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies made by reserve: performed in the target's pool and the head's."""
        if copies:
            self.target.copy_pages(copies)
            self.runner.copy_pages(copies)

    def _write(self, groups: list[tuple[HeadState, int, list[int]]]) -> None:
        """Write the head's entries of rows [first, first + len(ids)) of each state (ids: the token
        after each row), in one call."""
        groups = [g for g in groups if g[2]]
        if not groups:
            return
        ps, ids, positions, slots = self.runner.cfg.page_size, [], [], []
        for st, first, nxt in groups:
            ids += nxt
            positions += range(first, first + len(nxt))
            slots += [slot_of(st.seq.page_table, p, ps) for p in range(first, first + len(nxt))]
        hidden = torch.cat([st.rows(first, first + len(nxt)) for st, first, nxt in groups])
        dev = self.runner.to_device
        self.head.write_kv(dev(ids, torch.int64), dev(positions, torch.int64), hidden, self.runner.layer_caches,
                           dev(slots, torch.int64))

    @torch.inference_mode()
    def record(self, sched, plan, rows: list[tuple[int, int]]) -> None:
        """The target runner's hidden sink, after each step's forward: the step's states fused and
        stashed, and the head's entries written for every row whose next token is known."""
        for sid in [i for i, st in self.states.items() if st.seq.status in (SeqStatus.FINISHED, SeqStatus.WAITING)]:
            del self.states[sid]
        self.runner.copy_pages(plan.page_copies)       # the step's copy-on-write, in the head's pool too
        items = sched.scheduled
        if not items:
            return
        index = [r for first, n in rows for r in range(first, first + n)]
        fused = self.head.fuse(self.target.captured.index_select(0, self.target.to_device(index, torch.int64)))
        at, writes, copies = 0, [], []
        for item, (_, n) in zip(items, rows):
            seq, start = item.seq, item.start
            st = self._settle(seq)
            new = fused[at:at + n]
            at += n
            st.stash = new if st.stash is None else torch.cat([st.stash, new])
            nxt = known_tokens(seq, seq.draft_token_ids[:item.num_draft], st.kv_len + 1, start + n + 1)
            if st.kv_len < start and nxt:                  # rows before the step's own pages: maybe shared
                got = self.pages.reserve(seq, st.kv_len, start)
                if got is None:
                    continue
                copies += got
            writes.append((st, st.kv_len, nxt))
        self._mirror(copies)
        self._write(writes)
        for st, first, nxt in writes:
            final = max(0, min(len(nxt), st.seq.num_tokens - st.seq.num_pending - 1 - first))
            st.kv_len, st.fed = first + final, nxt[final:]
            st.keep(st.kv_len, st.stash_end)
        for item in items:
            self._fork(item)

    def _fork(self, item) -> None:
        """A request's first sample, at the end of its prompt: the samples forked from it next
        share its pages, so they take a copy of its state (their own first tokens follow)."""
        seq = item.seq
        if not item.samples or seq.sample_index or seq.num_output_tokens or seq.request.params.n < 2:
            return
        st = self.states[seq.seq_id]
        for child in seq.request.seqs[1:]:
            if child.status == SeqStatus.UNBORN:
                self.states[child.seq_id] = HeadState(child, st.kv_len, list(st.fed), st.stash_start, st.stash)

    # ---- drafting ------------------------------------------------------------------------------

    def _decode(self, step: DecodeInputs, previous: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """One decode-shaped step of the head (states in hidden_in[:n]): logits [n, vocab]. The
        static path (decode graphs) where the runner has it, else eagerly; `previous`: input ids
        on the device (a tensor, each row's index in it)."""
        graphs, n = self.runner.decode_graphs, len(step.seq_lens)
        if graphs is not None and n <= graphs.max_bs:
            return graphs.run(step, previous)
        dev = self.runner.to_device
        ids = previous[0].index_select(0, dev(previous[1], torch.int64)) if previous is not None \
            else dev(step.input_ids, torch.int64)
        meta = self.runner.metadata(step.slots, list(range(n + 1)), step.seq_lens, step.page_tables)
        return self.head.compute_logits(self.head(ids, dev(step.positions, torch.int64), self.runner.layer_caches, meta))

    def _prepare(self, seqs: list, limits: list[int]) -> list[tuple[int, HeadState, int, int]]:
        """(row, state, v, drafts) of each sequence that drafts: its state settled with row v - 1
        waiting, pages reserved up to position v + drafts - 2 (fewer drafts where the pool is
        short), and its entries before v - 1 written."""
        drafting, copies, writes = [], [], []
        for r, (seq, lim) in enumerate(zip(seqs, limits)):
            v = seq.num_computed_tokens
            st = self._settle(seq, cap=v - 1)             # row v - 1 runs again: its logits give draft 1
            if v < 1 or st.kv_len > v - 1:
                continue                               # no target state for row v - 1: no drafts
            got = None
            while lim > 0 and (got := self.pages.reserve(seq, st.kv_len, v + lim - 1)) is None:
                lim -= 1
            if got is None:
                continue
            copies += got
            drafting.append((r, st, v, lim))
            writes.append((st, st.kv_len, seq.token_ids[st.kv_len + 1:v]))
        self._mirror(copies)
        self._write(writes)
        return drafting

    def _draw(self, logits: torch.Tensor, seqs: list, j: int, drafted: list[list[int]] | None):
        """Draft j + 1 of each row: (tokens [n] on the device, q [n, vocab] or None for argmax).
        `drafted`: the drafts so far on the host (penalties count them as output)."""
        if all(map(plain_greedy, seqs)):
            return logits.argmax(dim=-1), None
        views = seqs if not drafted else [Sequence(s.seq_id, s.request, s.sample_index, s.token_ids + d,
                                                   s.num_prompt_tokens, s.seed) for s, d in zip(seqs, drafted)]
        batch = self.runner.sampling_batch(views, logits.shape[-1], self.eos_ids)
        if drafted is None and j:
            batch = dataclasses.replace(batch, steps=batch.steps + j)
        q = draft_probs(logits, batch)
        return sample_probs(q, batch.seeds, batch.steps), q

    @torch.inference_mode()
    def propose(self, seqs: list, limits: list[int]) -> Proposal:
        drafting = self._prepare(seqs, limits)
        k, vocab = max(limits), self.runner.model_cfg.vocab_size
        out: list[list[int]] = [[] for _ in seqs]
        if not drafting:
            return Proposal(out)
        greedy = all(map(plain_greedy, seqs))
        probs = None if greedy else torch.zeros(len(seqs), k, vocab, device=self.runner.device)
        penalties = any(s.request.params.uses_penalties for s in seqs)
        ps, n = self.runner.cfg.page_size, len(drafting)
        self.head.hidden_in[:n].copy_(torch.cat([st.rows(v - 1, v) for _, st, v, _ in drafting]))
        logits = self._decode(DecodeInputs(
            [st.seq.token_ids[v] for _, st, v, _ in drafting], [v - 1 for _, _, v, _ in drafting],
            [slot_of(st.seq.page_table, v - 1, ps) for _, st, v, _ in drafting], [v for _, _, v, _ in drafting],
            [st.seq.page_table for _, st, _, _ in drafting]))
        for _, st, v, _ in drafting:                     # row v - 1's entry is final: its next token is known
            st.kv_len, st.fed = v, []
            st.keep(v, v)
        cur, drawn = list(range(n)), []                   # rows of `drafting` in this step, their tokens
        for j in range(k):
            rows = [drafting[i] for i in cur]
            tokens, q = self._draw(logits, [st.seq for _, st, _, _ in rows], j,
                                   [out[r] for r, _, _, _ in rows] if penalties else None)
            if q is not None:
                probs[self.runner.to_device([r for r, _, _, _ in rows], torch.int64), j] = q
            if penalties:
                for (r, _, _, _), t in zip(rows, tokens.tolist()):
                    out[r].append(t)
            else:
                drawn.append((rows, tokens))
            nxt = [i for i in cur if drafting[i][3] > j + 1]
            if not nxt:
                break
            src = [cur.index(i) for i in nxt]
            self.head.hidden_in[:len(nxt)].copy_(self.head.hidden_out.index_select(
                0, self.runner.to_device(src, torch.int64)))
            at = [(drafting[i][1].seq, drafting[i][2] + j) for i in nxt]     # position v + j, token draft j + 1
            logits = self._decode(DecodeInputs(
                [0] * len(nxt), [p for _, p in at], [slot_of(s.page_table, p, ps) for s, p in at],
                [p + 1 for _, p in at], [s.page_table for s, _ in at]), previous=(tokens, src))
            cur = nxt
        for rows, tokens in drawn:                        # one read-back of all the drafts
            for (r, _, _, _), t in zip(rows, tokens.tolist()):
                out[r].append(t)
        return Proposal(out, probs)
