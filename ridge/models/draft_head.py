"""What every draft head that reads the target's hidden states has in common (an EAGLE-3 head,
ridge/models/eagle3.py; DeepSeek-V3's multi-token-prediction layer, ridge/models/mtp.py), the small
interface the head proposer (ridge/engine/spec/eagle.py) drives:

    capture_ids(target cfg)   the target's states it reads (LlamaModel.capture_layers' ids)
    fuse(captured)            the captured rows [T, n Ht] -> the head's input states [T, H]
    share_embedding(table)    the target's token table (the head embeds with it)
    allocate_hidden(rows)     static [rows, H] buffers: forward reads its states from hidden_in[:T]
                              and leaves its output before the final norm in hidden_out[:T] (a
                              chained draft step's input state), so decode graphs can hold it
    forward / compute_logits  the runner's model signature (ids, positions, kv caches, metadata)
    write_kv                  a row's cache entries without attending (they depend on its input alone)
"""
from __future__ import annotations

import torch
from torch import nn

from ridge.layers.embedding import VocabTable


class HiddenStateHead(nn.Module):
    """The embedding and the static state buffers of a head (module docstring)."""

    def __init__(self):
        super().__init__()
        self.hidden_in = self.hidden_out = None             # allocate_hidden
        self._target_embed: VocabTable | None = None        # share_embedding's, set after loading: never loaded

    def share_embedding(self, table: VocabTable) -> None:
        """The target's token table, used unless the checkpoint brought the head's own."""
        if table.weight.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"hidden_size: the head's is {self.cfg.hidden_size}, the target's table is "
                             f"{table.weight.shape[1]} wide")
        self._target_embed = table

    @property
    def embed(self) -> VocabTable:
        own = self._modules.get("embed_tokens")
        if own is None and self._target_embed is None:
            raise RuntimeError(f"{type(self).__name__}: no embedding (share_embedding(target table) first)")
        return own if own is not None else self._target_embed

    def allocate_hidden(self, rows: int) -> None:
        """The static [rows, H] buffers forward reads its states from and leaves its output in, in
        the embedding's dtype and on its device (share_embedding first)."""
        w = self.embed.weight
        self.hidden_in = torch.zeros(rows, self.cfg.hidden_size, dtype=w.dtype, device=w.device)
        self.hidden_out = torch.zeros_like(self.hidden_in)
