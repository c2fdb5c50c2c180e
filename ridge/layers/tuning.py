"""Startup tuning: which path serves a batch of m rows, measured once per GPU and shape, then looked up.

Three layers choose between kernel paths whose best choice depends on the GPU, the shape and the
batch: the FP8 GEMM (ridge/layers/quant/fp8/dispatch.py), the INT4 GEMM or its dequant path
(ridge/layers/quant/int4/dispatch.py) and the mixture-of-experts kernels (ridge/layers/moe_tuning.py,
float experts included: so this lives beside the layers rather than in quant/). Each times every
candidate at one representative batch per bucket, replayed from a CUDA graph as decode steps run
(ridge/utils/graph_timing.py), and keeps the fastest; a batch of m rows takes the choice of the
first bucket >= m (the last bucket's past it). The tables live under RIDGE_CACHE_DIR/<kind>, one
JSON file per device and shape, {bucket: {"choice", "us": {path: microseconds}, "errors": {path:
why}}} (ridge/utils/device_cache.py), so only the first start on a GPU pays for the timing.

What differs between the three is declared per candidate (`Path`), not written three times: the
errors that rule a path out (recorded, never chosen) rather than stop the engine, and the time
that bounds a path's timing (a candidate far slower than it cannot be the choice:
graph_time_us stops after one call).
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ridge.utils.device_cache import cache_root, device_key, locked, read_json, write_json
from ridge.utils.graph_timing import error_line, graph_time_us

# batch sizes a table is measured at: powers of two where the choice changes fastest (decode sizes)
BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BEST = "best"           # a Path's bound: the fastest candidate timed before it


def bucket_of(m: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The representative batch size whose choice serves m rows: the first bucket >= m, else the last."""
    return buckets[min(bisect.bisect_left(buckets, m), len(buckets) - 1)]


@dataclass(frozen=True)
class Path:
    """One candidate: `run` computes the layer's output by this path. `catch`: the errors that rule
    it out (a tile this GPU cannot fit, a 16-bit weight that does not fit beside the model), recorded
    in the table's "errors"; any other error is the engine's to raise. `bound`: the candidate (or
    BEST, the fastest so far) whose time bounds this one's timing."""
    run: Callable[[], object]
    catch: tuple[type[BaseException], ...] = ()
    bound: str | None = None


def time_paths(paths: dict[str, Path], timer: Callable = graph_time_us, best_us: float = float("inf"),
               sync_after_error: bool = False) -> dict:
    """{"choice": the fastest path (None where every one failed), "us": {path: microseconds}, "errors":
    {path: the error that ruled it out}}, each timed in order by `timer(fn, bound_us=...)`; best_us:
    the fastest time of candidates timed before these (a BEST bound counts it). sync_after_error: a
    device fault behind a caught error (which leaves the context unusable) is raised at once."""
    us, errors = {}, {}
    for name, path in paths.items():
        bound = min([*us.values(), best_us]) if path.bound == BEST else us.get(path.bound, float("inf"))
        try:
            us[name] = timer(path.run, bound_us=bound)
        except path.catch as e:
            if sync_after_error:
                torch.cuda.synchronize()
            errors[name] = error_line(e)
    return {"choice": min(us, key=us.get) if us else None, "us": us, "errors": errors}


def table_file(kind: str, prefix: str, device: torch.device, shape: str) -> str:
    """Where a table of `kind` ("fp8", "int4", "moe") for one shape on this device is cached."""
    return os.path.join(cache_root(), kind, f"{prefix}-{device_key(device)}-{shape}.json")


def measured(path: str, version: int, buckets: tuple[int, ...], measure: Callable[[tuple[int, ...]], dict]) -> dict:
    """The table cached at path, the buckets it lacks measured now (measure(buckets) -> {str(bucket):
    entry}) and added to it: a larger step budget later measures only what is new. The table is read
    again under a lock before it is written, so another process's entries added meanwhile stay."""
    table = read_json(path, version) or {}
    missing = tuple(b for b in buckets if str(b) not in table)
    if missing:
        new = measure(missing)
        with locked(path):
            table = {**(read_json(path, version) or {}), **new}
            write_json(path, version, table)
    return table
