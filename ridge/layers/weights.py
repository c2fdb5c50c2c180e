"""Each parameter carries its own loader, `param.weight_loader(param, loaded, shard_id=None)`, and
`param.shard_ids`, the checkpoint tensors a merged parameter is built from (None: exactly one). The
layer owning a parameter knows its layout (a merged QKV's shards; later INT4 packing, FP8 block
scales, a tensor-parallel rank's slice), so the model loader (ridge/models/loader.py) only streams
tensors and dispatches them by name.
"""
from __future__ import annotations

import inspect
import weakref

import torch


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy `loaded` into `param` or a view of one (converting dtype and device) after a shape check."""
    if shard_id is not None:
        raise ValueError(f"is a shard ({shard_id!r}) of a parameter that has no shards")
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class LayerLoader:
    """A layer's own loader method, held weakly: the layer holds the parameter, so a parameter
    holding its layer would make a reference cycle, and a model in cycles outlives its last user
    (its weights stay on the device) until the garbage collector happens to run."""

    def __init__(self, method):
        self.method = weakref.WeakMethod(method)

    def __call__(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        method = self.method()
        if method is None:
            raise RuntimeError("weight_loader: the layer owning this parameter no longer exists")
        method(param, loaded, shard_id)


def set_weight_loader(param: torch.nn.Parameter, loader=default_weight_loader, shard_ids=None,
                      takes_stored: bool = False):
    """Attach a loader (and the shard ids it expects) to a parameter; returns the parameter. A
    layer's bound method is held weakly (LayerLoader).
    takes_stored: the loader takes a checkpoint's stored quantized format whole (ridge/layers/quant/base.py
    StoredWeight); every other parameter is handed its dequantization."""
    param.weight_loader = LayerLoader(loader) if inspect.ismethod(loader) else loader
    param.shard_ids = tuple(shard_ids) if shard_ids is not None else None
    param.takes_stored = takes_stored
    return param
