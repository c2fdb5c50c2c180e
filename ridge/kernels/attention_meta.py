"""What every attention backend needs to know about one flat batch."""
from __future__ import annotations

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
