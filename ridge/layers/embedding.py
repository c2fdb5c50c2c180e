"""The token embedding and the LM head: one [vocab, hidden] table each (or one shared, when tied).

Under tensor parallelism (ridge/parallel.py) each rank holds an equal share of the vocabulary's
rows, the last share padded when the vocabulary does not divide: the LM head's rows are then the
rank's share of the logits (one all-gather puts them side by side; the padding columns are cut
off), and an embedding lookup is answered by the rank holding the token's row, the others adding
zeros in one all-reduce. One rank: the whole table, a plain lookup and one GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.layers.weights import default_weight_loader, set_weight_loader
from ridge.parallel import SINGLE, TensorParallel


class VocabTable(nn.Module):
    """`weight`: this rank's rows of the [vocab, hidden] checkpoint table (ids [start, start +
    rows)), padded with zero rows to an equal share."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.start, self.rows, share = tp.padded_split(vocab_size)
        self.weight = set_weight_loader(nn.Parameter(torch.empty(share, hidden_size), requires_grad=False),
                                        self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"has {loaded.shape[0]} rows, expected the vocabulary's {self.vocab_size}")
        default_weight_loader(param.data[:self.rows], loaded.narrow(0, self.start, self.rows), shard_id)
        param.data[self.rows:].zero_()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] rows (summed over the ranks)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, vocab] float32 logits, every rank's share gathered."""
        out = self.tp.all_gather(F.linear(hidden, self.weight))
        if out.shape[-1] != self.vocab_size:
            out = out[:, :self.vocab_size].contiguous()
        return out.float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)
