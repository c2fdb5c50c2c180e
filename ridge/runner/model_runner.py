"""Owns the model and the KV-cache pool; turns a scheduled step into one flat batch, runs the
forward pass and samples. The flat batch: the new tokens of every scheduled sequence end to end
(token ids, positions, cache slots), plus per sequence its query start, context length and page
table, built as host lists and moved to the device in one copy each.

The runner sits below the engine and imports nothing from it: a step is read through the
scheduler output's fields (`scheduled`: items with `seq`, `start`, `num_new_tokens`, `num_draft`,
`samples`; `page_copies`), a sequence through `token_ids`, `draft_token_ids`, `page_table`,
`request.params`. An item with drafts (speculative decoding) appends the sequence's draft tokens to
its chunk and samples its last num_draft + 1 rows.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ridge.config import EngineConfig, ModelConfig
from ridge.kernels.attention_meta import AttentionMetadata
from ridge.kernels.kv_fp8 import FP8 as KV_FP8, hadamard_signs
from ridge.runner.cuda_graphs import DecodeGraphs, DecodeInputs
from ridge.runner.sampling_inputs import sampling_batch
from ridge.runner.step_message import DECODE, EAGER, VERIFY, StepPlan
from ridge.layers.attention import kv_cache_spec_of, select_backend, tune_decode_kernels
from ridge.layers.sampler import SamplingBatch, info_on_host, logprob_info, sample
from ridge.models.loader import load_model
from ridge.parallel import SINGLE, TensorParallel

log = logging.getLogger("ridge")

# rows of prompt logits turned into log-probabilities at a time: bounds the [rows, vocab] buffer
_SCORE_ROWS = 1024


@dataclass
class ForwardOutput:
    logits: torch.Tensor                        # [rows that sample, vocab] float32
    static_decode: bool = False                 # served by the static decode path (graph replay)
    # (sequence, first prompt position, the prompt tokens from there, logprob_info of them given the
    # tokens before each, on the host) for requests that score their prompt
    prompt_logprobs: list[tuple[object, int, list[int], tuple]] = field(default_factory=list)
    # run()'s side of those: per score span of the plan, (offset in the span, targets, host info) chunks
    scores: list[list[tuple[int, list[int], tuple]]] = field(default_factory=list)


def slot_of(page_table: list[int], position: int, page_size: int) -> int:
    """The cache slot of a token: row position % page of the page holding it."""
    return page_table[position // page_size] * page_size + position % page_size


def plain_greedy(seq) -> bool:
    """The sequence's next token is the raw argmax: greedy, no penalties, no logprobs, no banned
    stop tokens (min_tokens reached)."""
    p = seq.request.params
    return p.temperature == 0 and p.logprobs is None and not p.uses_penalties and seq.num_output_tokens >= p.min_tokens


class ModelRunner:
    """`tp`: this process's tensor-parallel rank (its share of the model and of the KV heads);
    `workers` (rank 0 of a tensor-parallel engine): the other ranks' processes
    (ridge/runner/workers.py), which run each step's plan beside this one."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, show_progress: bool = True,
                 tp: TensorParallel = SINGLE, workers=None):
        self.cfg, self.model_cfg, self.device = cfg, model_cfg, cfg.device
        self.workers, self.tp = workers, workers.tp if workers is not None else tp
        if cfg.num_cpu_threads is not None:
            torch.set_num_threads(cfg.num_cpu_threads)
        rotation = hadamard_signs(model_cfg.head_dim, cfg.seed).to(cfg.device) if cfg.kv_cache_hadamard else None
        self.backend = select_backend(cfg.device, cfg.attention_backend, model_cfg.head_dim, rotation,
                                      model_cfg.mla.kv_lora_rank if model_cfg.mla is not None else None,
                                      KV_FP8 if cfg.fp8_kv_cache else cfg.dtype)
        self.model = load_model(cfg.model, model_cfg, cfg.dtype, cfg.device, self.backend,
                                max_position=max(cfg.max_model_len, 1), show_progress=show_progress,
                                load_format=cfg.load_format, seed=cfg.seed, quantization=cfg.quantization,
                                tp=self.tp, max_step_tokens=cfg.max_num_batched_tokens)
        self.kv_spec = kv_cache_spec_of(self.model)         # the pool holds what the attention layers declare
        self.cache_row = (self.kv_spec.streams, self.kv_spec.heads, self.kv_spec.width)
        # set by allocate_kv_cache (kv_scales: an FP8 cache's scale bytes, else None), setup_decode
        self.kv_cache, self.kv_scales, self.decode_graphs, self.verify_graphs = None, None, None, None
        self.warm_up_seconds = 0.0
        # pinned landing buffers + events for sampled ids read back without waiting (tokens_to_host):
        # at most two decode steps' ids are in flight (one committed, one launched ahead): two, in turn
        self._landing, self._landing_turn = [], 0
        # objects told when each execute / sample starts and ends: on_step_start(phase, arg),
        # on_step_end(phase, arg), phase "execute" (arg: the step) or "sample" (arg: the sequences)
        self.step_observers: list = []
        # called as hidden_sink(sched, plan, rows) after every step's forward, before the next one can
        # overwrite `captured` (capture_hidden): a head proposer's record of the target's states (EAGLE-3, MTP)
        self.hidden_sink = None
        self.captured: torch.Tensor | None = None
        if workers is not None:
            workers.before_leaving.append(self.release_graphs)

    def _observed(self, phase: str, arg, run, *args):
        for o in self.step_observers:
            o.on_step_start(phase, arg)
        out = run(*args)
        for o in self.step_observers:
            o.on_step_end(phase, arg)
        return out

    def capture_hidden(self, layer_ids: tuple[int, ...], rows: int) -> torch.Tensor:
        """Have every forward write the input stream of the given layers (LlamaModel.capture_layers)
        into a buffer this runner owns, [rows, len(layer_ids) * hidden] in the model's dtype, rows
        >= the most tokens a step runs. Called before start(), so the graphs capture the writes and
        the KV budget is measured with the buffer allocated."""
        self.captured = torch.empty(rows, len(layer_ids) * self.model_cfg.hidden_size, dtype=self.cfg.dtype,
                                    device=self.device)
        self.model.model.capture_layers(layer_ids, self.captured)
        return self.captured

    def item_rows(self, sched, plan: StepPlan) -> list[tuple[int, int]]:
        """(first row, rows) of each scheduled item's tokens in the forward's outputs (and in
        `captured`): the flat batch's query starts, a decode graph's row per sequence, a verify
        graph's `queries` rows per sequence (its padding after each item's tokens)."""
        items = sched.scheduled
        if plan.kind == DECODE:
            return [(r, 1) for r in range(len(items))]
        if plan.kind == VERIFY:
            return [(r * self.verify_graphs.queries, i.num_new_tokens) for r, i in enumerate(items)]
        return [(plan.query_starts[r], i.num_new_tokens) for r, i in enumerate(items)]

    def kv_element_bytes(self) -> float | None:
        """Bytes per cached element (its row's scale included) when the cache is not in the model
        dtype (FP8), else None."""
        s = self.kv_spec
        return s.row_bytes / s.width if s.dtype != self.cfg.dtype else None

    def kv_bytes_per_page(self) -> int:
        return self.model_cfg.num_layers * self.kv_spec.page_bytes(self.cfg.page_size)

    def allocate_kv_cache(self, num_pages: int) -> None:
        """One pool for all layers, as the attention layers declare it (KVCacheSpec): rows [layers,
        streams, pages, page size, heads, width] and, for a scaled format, their scales [layers,
        streams, pages, page size, heads] beside them; each layer's pages are views of its slice."""
        s = self.kv_spec
        shape = (self.model_cfg.num_layers, s.streams, num_pages, self.cfg.page_size, s.heads)
        self.kv_cache = torch.empty(*shape, s.width, dtype=s.dtype, device=self.device)
        if s.scale_dtype is not None:
            self.kv_scales = torch.ones(shape, dtype=s.scale_dtype, device=self.device)
        self.layer_caches = [s.pages(rows, None if self.kv_scales is None else self.kv_scales[i])
                             for i, rows in enumerate(self.kv_cache)]

    def pages_fitting(self, extra_page_bytes: int = 0) -> int:
        """KV pages the pool budget holds (cfg.kv_budget, measured now; `extra_page_bytes` a page
        of another pool sharing it), the fewest of any tensor-parallel rank's."""
        return self.tp.min_over_ranks(max(self.cfg.kv_budget(), 0) // (self.kv_bytes_per_page() + extra_page_bytes))

    def start(self, num_pages: int, use_graphs: bool, verify_queries: int = 1, verify_max_bs: int = 0) -> None:
        """The KV pool, the prefill warm-up and the decode setup, on every rank in this order (each
        runs collectives): rank 0 tells the other ranks first."""
        if self.workers is not None:
            self.workers.setup(num_pages, use_graphs, verify_queries, verify_max_bs)
        self.allocate_kv_cache(num_pages)
        self.warm_up_prefill()
        self.setup_decode(use_graphs, verify_queries, verify_max_bs)
        if self.device.type == "cuda":      # eager steps' kernel keys, tuned now rather than mid-serve
            tune_decode_kernels(self.model, self.layer_caches[0], self.cfg.max_num_seqs, self.cfg.max_model_len,
                                self.cfg.dtype)

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs before leaving a tensor-parallel group (DecodeGraphs.release)."""
        for g in filter(None, (self.decode_graphs, self.verify_graphs)):
            g.release()

    def close(self) -> None:
        """Drop what this runner holds on its device: the CUDA graphs (a graph is destroyed with its
        object, their memory pool with the last one), the KV pool, the model and the pinned landing
        buffers. Idempotent."""
        self.decode_graphs = self.verify_graphs = self.kv_cache = self.kv_scales = self.model = None
        self.captured, self.layer_caches, self._landing = None, [], []

    def setup_decode(self, use_graphs: bool, verify_queries: int = 1, verify_max_bs: int = 0) -> None:
        """Static decode buffers (after the KV pool exists), and CUDA graphs unless told not to; only
        with the Triton backend (the torch reference reads host-side lengths a graph cannot see
        change). On a CPU the Triton interpreter runs the same padded static path. With speculation,
        the same for verify steps of up to verify_max_bs sequences, verify_queries tokens each."""
        if self.backend.name != "triton":
            return
        # MLA's multi-token (verify) steps expand the latents by host-side lengths: eager
        graphs = [(self.cfg.max_num_seqs, 1)] + ([(verify_max_bs, verify_queries)] if verify_queries > 1
                                                 and verify_max_bs > 0 and self.model_cfg.mla is None else [])
        for max_bs, queries in graphs:
            g = DecodeGraphs(self.model, self.layer_caches, max_bs, self.cfg.max_model_len, self.cfg.page_size,
                             self.device, queries)
            g.fill_idle()
            if use_graphs and self.device.type == "cuda":
                g.capture()
            if queries == 1:
                self.decode_graphs = g
            else:
                self.verify_graphs = g

    @torch.inference_mode()
    def warm_up_prefill(self) -> None:
        """One throwaway prefill, so the first request does not pay for compiling and autotuning
        the prefill path (seconds on a GPU). The autotuner keeps the winner on the first shape it
        sees for every later one, so the chunk is a typical large one. Slot -1: nothing written."""
        if self.device.type != "cuda" or self.backend.name != "triton":
            return
        t0 = time.perf_counter()
        n = max(2, min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len, 2048))
        hidden = self.model(torch.randint(0, self.model_cfg.vocab_size, (n,), device=self.device),
                            torch.arange(n, device=self.device), self.layer_caches,
                            self.metadata([-1] * n, [0, n], [n], [[0] * -(-n // self.cfg.page_size)]))
        self.model.compute_logits(hidden[-1:]).argmax(dim=-1)
        torch.cuda.synchronize(self.device)
        self.warm_up_seconds = time.perf_counter() - t0
        log.info("prefill warm-up (%d tokens) in %.1f s", n, self.warm_up_seconds)

    def decode_inputs(self, sched) -> DecodeInputs | None:
        """The step as a pure decode batch (every sequence adds its one last token and samples),
        or None when it is anything else (a prefill chunk, prompt scoring, drafts to verify) or too
        large a batch."""
        items, g, ps = sched.scheduled, self.decode_graphs, self.cfg.page_size
        if g is None or len(items) > g.max_bs or any(
                i.num_new_tokens != 1 or not i.samples or i.seq.prompt_logprobs is not None for i in items):
            return None
        return DecodeInputs([i.seq.token_ids[i.start] for i in items], [i.start for i in items],
                            [slot_of(i.seq.page_table, i.start, ps) for i in items], [i.start + 1 for i in items],
                            [i.seq.page_table for i in items])

    def verify_inputs(self, sched) -> tuple[DecodeInputs, list[int]] | None:
        """The step as a verify batch (every sequence decodes its last token and its drafts, some
        none), each padded to the verify graphs' tokens a sequence (slot -1, the last real position),
        and the rows of their logits each item samples; None for any other step."""
        items, g, ps = sched.scheduled, self.verify_graphs, self.cfg.page_size
        if g is None or len(items) > g.max_bs or not any(i.num_draft for i in items) or any(
                not i.samples or i.num_new_tokens != 1 + i.num_draft or i.num_draft >= g.queries
                or i.seq.prompt_logprobs is not None for i in items):
            return None
        Q, step, rows = g.queries, DecodeInputs([], [], [], [], []), []
        for r, item in enumerate(items):
            seq, start, d = item.seq, item.start, item.num_draft
            pad = Q - 1 - d
            step.input_ids += [seq.token_ids[start], *seq.draft_token_ids[:d]] + [0] * pad
            step.positions += [*range(start, start + d + 1)] + [start + d] * pad
            step.slots += [slot_of(seq.page_table, p, ps) for p in range(start, start + d + 1)] + [-1] * pad
            step.seq_lens.append(start + Q)                # the cached prefix is [0, start)
            step.page_tables.append(seq.page_table)
            rows += range(r * Q, r * Q + d + 1)
        return step, rows

    def plan(self, sched, previous: tuple[torch.Tensor, list[int]] | None = None) -> tuple[StepPlan, list]:
        """The step as every rank runs it (StepPlan: host lists), and, for the requests that score
        their prompt, (sequence, first position) of each of its score spans. `previous`: see execute."""
        copies, decode = sched.page_copies, self.decode_inputs(sched)
        if decode is not None:
            rows, n = (previous[1], previous[0].numel()) if previous is not None else (None, 0)
            return StepPlan(DECODE, decode, copies, previous_rows=rows, num_previous=n), []
        verify = self.verify_inputs(sched) if previous is None else None
        if verify is not None:
            return StepPlan(VERIFY, verify[0], copies, sample_rows=verify[1]), []
        if previous is not None:
            raise RuntimeError("execute: a step with input ids still on the device must be a static decode step")
        ps, plan, scored = self.cfg.page_size, StepPlan(EAGER, DecodeInputs([], [], [], [], []), copies, [0]), []
        step = plan.inputs
        for item in sched.scheduled:
            seq, start, n, drafts = item.seq, item.start, item.num_new_tokens, item.num_draft
            step.input_ids += seq.token_ids[start:start + n - drafts]
            if drafts:                      # speculation: the target scores each draft position too
                step.input_ids += seq.draft_token_ids[:drafts]
            step.positions += range(start, start + n)
            step.slots += [slot_of(seq.page_table, p, ps) for p in range(start, start + n)]
            step.seq_lens.append(start + n)
            step.page_tables.append(seq.page_table)
            row0 = plan.query_starts[-1]
            plan.query_starts.append(row0 + n)
            if item.samples:
                plan.sample_rows += range(row0 + n - 1 - drafts, row0 + n)
            # row r of this chunk (position start + r) predicts the token at position start + r + 1
            last = min(start + n, seq.num_prompt_tokens - 1)
            if seq.prompt_logprobs is not None and last > start:
                plan.score_rows.append(row0)
                plan.score_targets.append(seq.token_ids[start + 1:last + 1])
                plan.score_top.append(seq.request.params.prompt_logprobs)
                scored.append((seq, start + 1))
        return plan, scored

    def metadata(self, slots: list[int], starts: list[int], seq_lens: list[int], tables: list[list[int]]):
        """AttentionMetadata of a flat batch from host lists (page tables padded with page 0)."""
        to_dev, width = self.to_device, max(map(len, tables))
        return AttentionMetadata(to_dev(slots, torch.int64), to_dev(starts, torch.int32), to_dev(seq_lens, torch.int32),
                                 to_dev([t + [0] * (width - len(t)) for t in tables], torch.int32), starts, seq_lens,
                                 max(b - a for a, b in zip(starts, starts[1:])), max(seq_lens))

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor through pinned memory, without waiting for the GPU (a copy
        from pageable memory would block the host until every queued kernel has run)."""
        pinned = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(self.device, non_blocking=pinned)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = (self.to_device(list(c), torch.int64) for c in zip(*copies))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
            if self.kv_scales is not None:
                self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def execute(self, sched, previous: tuple[torch.Tensor, list[int]] | None = None) -> ForwardOutput:
        """One step's forward (rank 0, which schedules): logits of the rows that sample, prompt
        log-probabilities of requests that score their prompt. `previous` = (the last step's sampled
        ids, still on the device; each row's index in there): the overlapped decode, whose ids have
        not reached the host (static path only). The other tensor-parallel ranks get the plan
        through the step ring and run it beside this one."""
        return self._observed("execute", sched, self._execute, sched, previous)

    def _execute(self, sched, previous: tuple[torch.Tensor, list[int]] | None = None) -> ForwardOutput:
        plan, scored = self.plan(sched, previous)
        tokens = previous[0] if previous is not None else None
        if self.workers is None:
            out = self.run(plan, tokens)
        else:
            out = self.workers.step(plan, lambda: self.run(plan, tokens))
        if self.hidden_sink is not None:
            self.hidden_sink(sched, plan, self.item_rows(sched, plan))
        out.prompt_logprobs = [(seq, first + lo, targets, info) for (seq, first), chunks in zip(scored, out.scores)
                               for lo, targets, info in chunks]
        return out

    @torch.inference_mode()
    def run(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> ForwardOutput:
        """Run a step's plan, on every tensor-parallel rank alike. previous_tokens: rank 0's ids of
        the step before, for a decode step launched before they reached the host (the other ranks
        receive them by broadcast)."""
        self.copy_pages(plan.page_copies)
        if plan.kind == DECODE:
            previous = None
            if plan.previous_rows is not None:
                if previous_tokens is None:
                    previous_tokens = torch.empty(plan.num_previous, dtype=torch.int64, device=self.device)
                previous = (self.tp.broadcast(previous_tokens), plan.previous_rows)
            return ForwardOutput(self.decode_graphs.run(plan.inputs, previous), static_decode=True)
        if plan.kind == VERIFY:
            logits = self.verify_graphs.run(plan.inputs)
            return ForwardOutput(logits.index_select(0, self.to_device(plan.sample_rows, torch.int64)))
        step = plan.inputs
        meta = self.metadata(step.slots, plan.query_starts, step.seq_lens, step.page_tables)
        hidden = self.model(self.to_device(step.input_ids, torch.int64), self.to_device(step.positions, torch.int64),
                            self.layer_caches, meta)
        out = ForwardOutput(self.model.compute_logits(hidden.index_select(0, self.to_device(plan.sample_rows,
                                                                                            torch.int64))))
        for row0, targets, top in zip(plan.score_rows, plan.score_targets, plan.score_top):
            chunks = []
            for lo in range(0, len(targets), _SCORE_ROWS):
                tgt = targets[lo:lo + _SCORE_ROWS]
                logits = self.model.compute_logits(hidden[row0 + lo:row0 + lo + len(tgt)])
                chunks.append((lo, tgt, info_on_host(logprob_info(logits, self.to_device(tgt, torch.int64), top))))
            out.scores.append(chunks)
        return out

    def tokens_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying sampled ids to pinned host memory without waiting; the event marks
        when the copy (and so the step) is done. On a CPU the ids are already on the host."""
        if tokens.device.type != "cuda":
            return tokens, None
        n = tokens.numel()
        if not self._landing or self._landing[0][0].numel() < n or self._landing[0][0].dtype != tokens.dtype:
            self._landing = [(torch.empty(max(n, self.cfg.max_num_seqs), dtype=tokens.dtype, pin_memory=True),
                              torch.cuda.Event()) for _ in range(2)]
        buf, done = self._landing[self._landing_turn]
        self._landing_turn ^= 1
        host = buf[:n].view(tokens.shape).copy_(tokens, non_blocking=True)
        done.record()
        return host, done

    def host_tokens(self, host: torch.Tensor, done: torch.cuda.Event | None = None) -> list[int]:
        """The ids of tokens_to_host (or of a device tensor), once they have landed (waits for
        them). Under tensor parallelism a rank that died meanwhile had its step aborted (NCCL):
        RankFailure instead of that step's ids."""
        if self.workers is None:
            if done is not None:
                done.synchronize()
            return host.tolist()
        with self.workers.device_wait():        # bounded: a hung rank stalls the device, not the host
            if done is not None:
                done.synchronize()
            ids = host.tolist()
        self.workers.check()
        return ids

    def sample(self, logits: torch.Tensor, seqs: list, eos_ids: list[int]):
        return self._observed("sample", seqs, self._sample, logits, seqs, eos_ids)

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, seqs: list, eos_ids: list[int]):
        if all(map(plain_greedy, seqs)):   # one argmax launch, no per-row parameters
            return logits.argmax(dim=-1), None
        return sample(logits, self.sampling_batch(seqs, logits.shape[-1], eos_ids))

    def sampling_batch(self, seqs: list, vocab: int, eos_ids: list[int]) -> SamplingBatch:
        """Per-row parameters as device tensors (ridge/runner/sampling_inputs.py), copied through
        pinned memory without blocking."""
        return sampling_batch(seqs, vocab, eos_ids, self.to_device, self.device)
