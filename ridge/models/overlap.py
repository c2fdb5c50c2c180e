"""The decoder's layers over two micro-batches, each one's all-reduces overlapped with the other's
compute (issue 20, item 3): where tensor parallelism's collectives can hide, and where they cannot.

A decoder layer under Megatron's split (ridge/parallel.py) is: norm, QKV, attention, o_proj's
partial sum, ALL-REDUCE, residual add + norm, gate/up, down's partial sum, ALL-REDUCE. Everything
after an all-reduce needs its result, so inside one layer nothing independent of it exists. Work
independent of a collective comes only from other tokens: cut the step's tokens into two
micro-batches A and B, and while A's partial sum is being summed B computes, then the other way:

    compute:  A attn   B attn   A mlp    B mlp    A attn   B attn   ...   (layer i, then i + 1)
    network:           A sum    B sum    A sum    B sum    A sum    ...

(compute on the current stream; under NCCL an async all-reduce runs on the communicator's own
stream, and its wait() makes the current stream wait, not the host). Each layer runs A's attention
before B's: where the cut falls inside one sequence, B's queries read A's K/V of the same layer
from the cache, written by A's attention just before (ridge/kernels/attention_meta.py token_slice).

What the split costs: every weight of the layer is read twice, once per micro-batch. From the
layers' own costs (ridge/layers/cost.py, LlamaDecoderLayer.cost at TP = 2, bf16, an H100's
datasheet roofs of 3.35 TB/s and 989 TFLOP/s, each op at max(FLOPs / peak, bytes / bandwidth)),
one layer's time whole and as two halves, against the communication the split could hide (two
all-reduces of [T, hidden] bf16 a layer, ~360 GB/s of NVLink bus bandwidth):

    shape  step              layer     two halves  extra    all-reduce time a layer
    8B     decode, batch 1     66 us     132 us    +66 us   ~0.1 us + latency (17.6 us exposed, measured)
    8B     decode, batch 64   109 us     174 us    +65 us   6 us + latency (28.2 us exposed, measured)
    8B     prefill 512        133 us     164 us    +31 us   24 us
    8B     prefill 1024       268 us     268 us     +0.5    48 us
    8B     prefill 4096      1122 us    1122 us     0      192 us
    70B    prefill 512        482 us     576 us    +94 us   48 us
    70B    prefill 1024       968 us     968 us     +0.7    96 us
    70B    prefill 4096      3975 us    3975 us     0      383 us

A decode step is a weight stream (218 MB a layer a rank for 8B): splitting it adds a whole
second read of the weights, 3-4x the communication it could hide, so decode runs whole (and in
its CUDA graph, with the all-reduces captured inline). A prefill half of M tokens runs GEMMs of
about M FLOPs a weight byte (bf16), compute-bound once M is past the ridge point (989 / 3.35 =
295 on an H100, 206 on an H200): there the second weight read hides under the FLOPs and the
split is free, while the communication to hide grows with the tokens. Hence OVERLAP_MIN_TOKENS =
1024: halves of 512 tokens, past the ridge with margin for GEMM efficiency at that M; at 512
tokens (halves of 256, below it) the cost model says the split loses. The same holds for FP8
weights (half the bytes, twice the peak: the same ridge in tokens).

Numerics: per token nothing changes - the same ops on the same rows, the same reduction over the
ranks (at TP = 2 a sum of two, which no order changes). A GEMM over fewer rows may pick another
kernel, and a sequence cut in two reads its first half's K/V from the cache instead of from the
new rows (the same values, another block order in the online softmax): within the TP tests'
tolerances, not promised bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ridge.kernels.attention_meta import AttentionMetadata, token_slice
from ridge.parallel import TensorParallel

# tokens in a step from which its layers run as two overlapped micro-batches (see above)
OVERLAP_MIN_TOKENS = 1024


def overlap_cut(meta: AttentionMetadata, tp: TensorParallel, x: torch.Tensor) -> int | None:
    """The token at which to cut the step into micro-batches A = [0, cut) and B = [cut, T), or None
    to run it whole: one rank, too few tokens, or inside a CUDA graph's capture (a graph replays
    what it captured: the overlap is an eager step's). The cut is the sequence boundary nearest the
    middle unless that leaves a micro-batch under a quarter of the tokens; then the middle token."""
    T = meta.query_start_loc_cpu[-1]
    if tp.size == 1 or T < OVERLAP_MIN_TOKENS or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    cut = min(meta.query_start_loc_cpu[1:-1], key=lambda s: abs(2 * s - T), default=T // 2)
    return cut if min(cut, T - cut) >= T // 4 else T // 2


@dataclass
class MicroBatch:
    positions: torch.Tensor
    meta: AttentionMetadata
    x: torch.Tensor
    residual: torch.Tensor | None = None
    pending: object = None          # the async all-reduce of x in flight

    def ready(self) -> None:
        """Wait for x's sum over the ranks before reading it."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def run_overlapped(layers, kv_caches, tp: TensorParallel, positions: torch.Tensor, x: torch.Tensor,
                   meta: AttentionMetadata, cut: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers over x ([T, hidden], the summed embeddings) as micro-batches [0, cut) and
    [cut, T): (hidden states, residual), each [T, hidden], as the layers run whole would give."""
    T = x.shape[0]
    halves = [MicroBatch(positions[lo:hi], token_slice(meta, lo, hi), x[lo:hi]) for lo, hi in ((0, cut), (cut, T))]
    for layer, kv_cache in zip(layers, kv_caches):
        for h in halves:            # A's attention first: B's queries may read A's K/V of this layer
            h.ready()
            h.x, h.residual = layer.attention_block(h.positions, h.x, h.residual, kv_cache, h.meta, reduce=False)
            h.pending = tp.all_reduce_async(h.x)
        for h in halves:
            h.ready()
            h.x, h.residual = layer.mlp_block(h.x, h.residual, reduce=False)
            h.pending = tp.all_reduce_async(h.x)
    for h in halves:
        h.ready()
    return torch.cat([h.x for h in halves]), torch.cat([h.residual for h in halves])
