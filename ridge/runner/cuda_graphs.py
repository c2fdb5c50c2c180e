"""CUDA graphs for decode steps. A batch-1 decode step of an 8B model is ~4 ms of GPU work in ~400
kernel launches; run eagerly, Python spends about as long launching them as the GPU running them,
and the GPU idles in between. A captured graph replays all of them with one launch.

One graph per batch-size bucket (1, 2, 4, 8, then steps of 8 up to max_num_seqs): n sequences
replay the smallest bucket >= n, its padding rows empty (no query, slot -1: no cache read or
write). Graphs replay fixed addresses, so every input lives in a static buffer filled in place:
a step is two host->device copies (pinned int64 and int32 staging) and one replay; the logits
buffer is static too. When a step is launched before the previous step's sampled ids reached the
host (async scheduling), one gather on the device fills the input ids from those ids.

The attention kernels' launch parameters (split count, tiles) are fixed at capture for the
longest context, max_model_len; the split kernel divides each sequence's actual length among its
splits at run time, so short contexts pay only for empty programs. With graphs off
(`enforce_eager`), decode steps run the same kernels eagerly on the same static buffers and
padding, so graphs on and off give bit-identical outputs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ridge.kernels.attention_meta import AttentionMetadata

log = logging.getLogger("ridge")


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sizes if sizes and sizes[-1] == max_num_seqs else sizes + [max_num_seqs]


@dataclass
class DecodeInputs:
    """One decode (or verify) step as host lists: per sequence its `queries` tokens' ids, positions
    and slots, end to end, and per sequence its length and pages."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    page_tables: list[list[int]]


class DecodeGraphs:
    """`queries` tokens a sequence: 1 for decode steps; k + 1 for speculative verify steps, whose
    shorter drafts are padded (slot -1, rows not read), so one graph per batch bucket serves every
    draft length: in the memory-bound batches where speculation runs, the padded rows cost little."""

    def __init__(self, model, layer_caches, max_num_seqs: int, max_model_len: int, page_size: int,
                 device: torch.device, queries: int = 1):
        self.model, self.layer_caches, self.device, self.queries = model, layer_caches, device, queries
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs, self.max_pages, self.max_model_len = self.buckets[-1], -(-max_model_len // page_size), max_model_len
        B, P, T = self.max_bs, self.max_pages, self.max_bs * queries
        # int64 staging: [input_ids | positions | slots (T each) | source rows of ids still on the
        # device (B)]; int32: [query_start_loc (B+1) | seq_lens | tables]. Two pinned sets, used in
        # turn: with the engine's overlapped decode, step N+1 is staged while step N's copies may
        # still be queued behind the GPU's work, but by step N+2 the engine has waited for step N.
        pin = device.type == "cuda"
        self.host64 = [torch.zeros(3 * T + B, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host32 = [torch.zeros(2 * B + 1 + B * P, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.host_tables = [h[2 * B + 1:].view(B, P).numpy() for h in self.host32]
        self.turn = 0
        self.dev64 = torch.zeros(3 * T + B, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(2 * B + 1 + B * P, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slots = self.dev64[:3 * T].view(3, T)
        self.source_rows = self.dev64[3 * T:]
        self.query_start_loc, self.seq_lens = self.dev32[:B + 1], self.dev32[B + 1:2 * B + 1]
        self.page_tables = self.dev32[2 * B + 1:].view(B, P)
        self.graphs, self.logits = {}, {}          # bucket -> its CUDA graph, its static logits
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        L, Q = self.max_model_len, self.queries
        return AttentionMetadata(self.slots[:bs * Q], self.query_start_loc[:bs + 1], self.seq_lens[:bs],
                                 self.page_tables[:bs], list(range(0, (bs + 1) * Q, Q)), [L] * bs, max_query_len=Q,
                                 max_seq_len=L)

    def _forward(self, bs: int) -> torch.Tensor:
        rows = bs * self.queries
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], self.layer_caches, self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket on fill_idle's harmless inputs (fill them first), largest first, all
        sharing one memory pool (a smaller graph's activations fit in the space of a larger one's)."""
        t0, pool = time.perf_counter(), None
        for bs in reversed(self.buckets):
            self._forward(bs)                      # compile / autotune outside the capture
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool, self.graphs[bs] = g.pool(), g
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d %s CUDA graphs (batch %s) in %.1f s", len(self.graphs),
                 "decode" if self.queries == 1 else f"verify ({self.queries} tokens a sequence)",
                 ",".join(map(str, self.buckets)), self.capture_seconds)

    def release(self) -> None:
        """Destroy the captured graphs. NCCL will not tear down a communicator while a graph that
        captured its collectives lives (it waits for them, forever), so a tensor-parallel rank
        calls this before it leaves its group."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.logits.clear()

    @torch.inference_mode()
    def fill_idle(self) -> None:
        """Harmless inputs in every row: `queries` queries a sequence, slot -1, no cached prefix."""
        self.dev64.zero_()
        self.slots.fill_(-1)
        self.query_start_loc.copy_(torch.arange(0, (self.max_bs + 1) * self.queries, self.queries,
                                                dtype=torch.int32, device=self.device))
        self.seq_lens.fill_(self.queries)
        self.page_tables.zero_()

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, step: DecodeInputs, previous: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Fill the static inputs for n sequences and replay; returns logits [n * queries, vocab].
        With `previous` = (the last step's sampled ids on the device, each input's row in it), the
        input ids are gathered on the device: the host has not seen them, and step.input_ids holds
        PENDING ids in their place. Only decode steps (queries = 1) are launched that way."""
        n, B, P, Q = len(step.seq_lens), self.max_bs, self.max_pages, self.queries
        T, nq = B * Q, len(step.seq_lens) * Q
        bs = self.bucket_for(n)
        h64, h32, tables = self.host64[self.turn], self.host32[self.turn], self.host_tables[self.turn]
        self.turn ^= 1
        if previous is None:
            if nq and min(step.input_ids) < 0:
                raise RuntimeError("decode step: an input id is still pending on the device")
            h64[:nq] = torch.tensor(step.input_ids, dtype=torch.int64)
        else:
            h64[3 * T:3 * T + n] = torch.tensor(previous[1], dtype=torch.int64)
        h64[T:T + nq] = torch.tensor(step.positions, dtype=torch.int64)
        h64[2 * T:2 * T + nq] = torch.tensor(step.slots, dtype=torch.int64)
        h64[2 * T + nq:2 * T + bs * Q] = -1                  # padding rows write nowhere
        # query_start_loc: sequence i owns queries [i Q, (i + 1) Q); padding sequences own none
        h32[:n + 1] = torch.arange(0, (n + 1) * Q, Q, dtype=torch.int32)
        h32[n + 1:bs + 1] = nq
        h32[B + 1:B + 1 + n] = torch.tensor(step.seq_lens, dtype=torch.int32)
        h32[B + 1 + n:B + 1 + bs] = 1
        for i, t in enumerate(step.page_tables):     # numpy view of the pinned buffer: cheap row writes
            tables[i, :len(t)] = t
        self.dev64.copy_(h64, non_blocking=True)
        rows = 2 * B + 1 + bs * P                          # only the rows this bucket reads
        self.dev32[:rows].copy_(h32[:rows], non_blocking=True)
        if previous is not None:
            torch.index_select(previous[0], 0, self.source_rows[:n], out=self.input_ids[:n])
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.logits[bs][:nq]
        with torch.inference_mode():
            return self._forward(bs)[:nq]
