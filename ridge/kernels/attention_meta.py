"""What every attention backend needs to know about one flat batch, and of a range of its tokens
run on their own (token_slice)."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor     # [B+1] int32: cumulative query lengths (device)
    seq_lens: torch.Tensor            # [B] int32: context length after this step (device)
    page_tables: torch.Tensor        # [B, max_pages] int32: logical page -> physical page (device)
    query_start_loc_cpu: list[int]    # host copies, so no backend has to synchronise to read them
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def token_slice(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    """The metadata of the batch's tokens [lo, hi) run on their own (a micro-batch,
    ridge/models/overlap.py): the sequences they touch, each with its query rows clipped to the
    range and its context ending at its last row inside it. A sequence cut at lo is one whose
    earlier rows ran just before (an earlier micro-batch of the same layer), so its context up to lo
    is in the cache; one cut at hi reads nothing past its last row in the range (causal), so the
    rows after it, not yet written, are outside its context. Page tables are views; the device
    tensors are computed on the device from the batch's own, so nothing waits for the GPU."""
    starts = meta.query_start_loc_cpu
    if not 0 <= lo < hi <= starts[-1]:
        raise ValueError(f"token_slice: need 0 <= lo < hi <= {starts[-1]} tokens, got [{lo}, {hi})")
    first, last = bisect_right(starts, lo) - 1, bisect_right(starts, hi - 1) - 1     # sequences of lo, hi - 1
    new_starts = [min(max(s, lo), hi) - lo for s in starts[first:last + 2]]
    seq_lens = [n - max(end - hi, 0) for n, end in zip(meta.seq_lens_cpu[first:last + 1], starts[first + 1:last + 2])]
    ends = meta.query_start_loc[first + 1:last + 2]
    return AttentionMetadata(
        meta.slot_mapping[lo:hi], meta.query_start_loc[first:last + 2].clamp(lo, hi) - lo,
        meta.seq_lens[first:last + 1] - (ends - hi).clamp(min=0), meta.page_tables[first:last + 1],
        new_starts, seq_lens, max(b - a for a, b in zip(new_starts, new_starts[1:])), max(seq_lens))
