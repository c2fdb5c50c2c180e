"""How a checkpoint tensor lands in a parameter: each parameter carries its own loader.

`param.weight_loader(param, loaded, shard_id=None)` copies one checkpoint tensor into the
parameter, and `param.shard_ids` names the checkpoint tensors a merged parameter is built from
(None: exactly one). The layer that owns a parameter knows its layout - where a shard of a
merged QKV sits, and later how INT4 weights are packed, where FP8 block scales go, which slice
a tensor-parallel rank keeps - so that knowledge lives with the layer, and the model loader
(ridge/models/loader.py) only streams tensors and dispatches them by name.
"""
from __future__ import annotations

import torch


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy `loaded` into `param` (converting its dtype and device) after a shape check."""
    if shard_id is not None:
        raise ValueError(f"is a shard ({shard_id!r}) of a parameter that has no shards")
    copy_checked(param.data, loaded)


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def set_weight_loader(param: torch.nn.Parameter, loader=default_weight_loader, shard_ids=None):
    """Attach a loader (and the shard ids it expects) to a parameter; returns the parameter."""
    param.weight_loader = loader
    param.shard_ids = tuple(shard_ids) if shard_ids is not None else None
    return param
