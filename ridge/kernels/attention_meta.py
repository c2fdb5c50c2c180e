"""What every attention backend needs to know about one flat batch, and what an attention layer
keeps in the paged KV pool: its declaration (KVCacheSpec) and its pages as the kernels read them
(KVPages, LatentPages)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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


class KVPages(NamedTuple):
    """One layer's K and V pages [pages, page size, kv heads, head dim]; an FP8 cache's scale bytes
    [pages, page size, kv heads] beside them, one a row (None for a 16/32-bit cache)."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.k_scale is None else (self.k_scale, self.v_scale)


class LatentPages(NamedTuple):
    """One layer's latent pages [pages, page size, 1, kv_lora_rank + rope dim] (MLA)."""
    latent: torch.Tensor


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps a token in the paged pool, declared by the layer (it knows
    its heads, widths and cache dtype; ridge/layers/attention.py, mla.py): `streams` sets of `heads`
    rows of `width` values in `dtype` (K and V, or MLA's one latent row), and for a scaled format
    (FP8) one `scale_dtype` value a row. The runner allocates exactly this and sizes the pool by
    its bytes a page."""
    streams: int
    heads: int
    width: int
    dtype: torch.dtype
    scale_dtype: torch.dtype | None = None
    latent: bool = False               # the rows are MLA latents (LatentPages), else K and V (KVPages)

    @property
    def row_bytes(self) -> int:
        """One row's bytes: its values and, for a scaled format, its scale."""
        scale = self.scale_dtype.itemsize if self.scale_dtype is not None else 0
        return self.width * self.dtype.itemsize + scale

    def page_bytes(self, page_size: int) -> int:
        """One layer's bytes of one page."""
        return self.streams * page_size * self.heads * self.row_bytes

    def pages(self, rows: torch.Tensor, scales: torch.Tensor | None = None) -> KVPages | LatentPages:
        """One layer's pages as the layer reads them, from its slice of the pool: rows [streams,
        pages, page size, heads, width], scales [streams, pages, page size, heads] (scaled formats)."""
        if self.latent:
            return LatentPages(rows[0])
        return KVPages(rows[0], rows[1], *((scales[0], scales[1]) if self.scale_dtype is not None else ()))
