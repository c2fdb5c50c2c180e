"""Which MoE kernel path and tiles serve a batch: measured once per GPU, then looked up.

The expert kernels (ridge/kernels/moe_gemm.py) have two paths, and each has tile sizes whose best
values depend on the GPU, the expert shape (E, H, I, top_k) and the number of tokens: at a few
tokens the small-batch GEMVs stream weights and want many small programs; at thousands the
grouped GEMM is compute-bound and wants large tensor-core tiles; in between the aligned layout's
padding and the tile height trade against each other. So for each expert shape the engine
loading it times, at one representative token count per bucket (BUCKETS), every candidate on
the same random operands (routing drawn uniformly, as a trained router spreads load on average),
replayed from a CUDA graph as decode steps are: the small path's gate/up and down tiles
separately, and the grouped path's per tile height (alignment included) with its top-k sum in
the down GEMM and after it (the fused sum saves a launch but puts its reads in the GEMM's
epilogue, exposed: measured, it wins at tens of tokens and loses at thousands), and keeps the
fastest path and tiles per bucket (a candidate far slower than the best so far is dropped after
one call: graph_time_us). Within a bucket a token's output does not depend on the rest of
the batch; across buckets the path or tiles may change, and with them the last bit. A step of T
tokens takes the choice of the first bucket >= T. Only the buckets the engine's step budget
(max_num_batched_tokens) reaches are timed; cached per device by ridge/layers/tuning.py (RIDGE_CACHE_DIR/moe) like the FP8 and INT4
dispatches, a larger budget later adds the buckets it lacks.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from ridge.kernels.moe_gemm import (FUSED_SUM_OK, SMALL_MAX_TOKENS, GroupedTiles, SmallTiles, fused_moe_grouped,
                                    fused_moe_small, grouped_gemm, small_down_block_k)
from ridge.kernels.moe_quant import format_name, tiles_fit
from ridge.kernels.moe_route import align_by_expert
from ridge.layers.tuning import BEST, Path, bucket_of, measured, table_file, time_paths
from ridge.utils.graph_timing import graph_time_us

log = logging.getLogger("ridge")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SMALL_CANDIDATES = [SmallTiles(*c) for c in ((8, 256, 4, 3), (16, 128, 4, 3), (16, 256, 4, 3), (32, 128, 4, 3),
                                             (16, 128, 4, 4), (8, 128, 4, 4), (32, 64, 4, 4))]
# INT4 gate/up with 128-wide K tiles runs on tensor cores (ridge/kernels/moe_int4.py), which want
# 32+ columns a warp
INT4_SMALL_CANDIDATES = [SmallTiles(*c) for c in ((64, 128, 2, 4), (128, 128, 4, 4), (32, 128, 1, 4))]
GROUPED_CANDIDATES = [GroupedTiles(*c) for c in (
    (16, 32, 64, 4, 4), (16, 64, 64, 4, 4), (32, 64, 64, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 3), (128, 256, 64, 8, 3))]
# INT4 grouped tiles one group (128) wide run the nibble-plane loop (ridge/kernels/moe_int4.py)
INT4_GROUPED_CANDIDATES = [GroupedTiles(*c) for c in (
    (16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 4, 3), (64, 64, 128, 4, 3),
    (64, 128, 128, 8, 3), (128, 128, 128, 8, 3))]
# the top-k sum in the down GEMM (where this Triton can), or a torch sum after it
GROUPED_PATHS = ("grouped", "grouped-torch-sum") if FUSED_SUM_OK else ("grouped-torch-sum",)
VERSION = 5                # 4: the down GEMM fuses the top-k sum; 5: INT4's plane tiles


class MoePlan:
    """Per bucket: ("small", (gate/up tiles, down tiles)) or ("grouped", (gate/up tiles, down tiles))."""

    def __init__(self, table: dict[int, tuple[str, tuple]], us: dict[int, dict] | None = None):
        self.table = table
        self.buckets = sorted(table)
        self.us = us or {}          # bucket -> {path: measured microseconds}

    def choice(self, tokens: int) -> tuple[str, tuple]:
        return self.table[bucket_of(tokens, tuple(self.buckets))]


def _tiles(kind: str, raw) -> tuple:
    cls = SmallTiles if kind == "small" else GroupedTiles
    return tuple(cls(*t) for t in raw)


def _us(fn, bound_us: float = float("inf")) -> float:
    """fn's time; inf for a candidate this GPU cannot run (a tile past its shared memory or registers)."""
    return _time_all({"run": fn}, bound_us)["run"]


def _time_all(candidates, best_us: float = float("inf")) -> dict:
    """{candidate: us} (inf: it failed), each timed against the best so far (graph_time_us stops
    early on a loser)."""
    names = {str(i): c for i, c in enumerate(candidates)}       # table keys are strings; tiles are tuples
    timed = time_paths({i: Path(candidates[c], catch=(Exception,), bound=BEST) for i, c in names.items()},
                       timer=graph_time_us, best_us=best_us, sync_after_error=True)["us"]
    return {c: timed.get(i, float("inf")) for i, c in names.items()}


def _raise_clocks(device: torch.device, seconds: float = 0.2) -> None:
    """Keep the GPU busy for a moment first: an idle GPU runs its first milliseconds of work at
    lower clocks, which would make the first bucket's (the microsecond decode kernels') timings
    too slow, and by different amounts per candidate."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= seconds * 1e3:
            return


def _best(timings: dict) -> tuple:
    return min(timings, key=timings.get)


def buckets_for(max_tokens: int | None) -> tuple[int, ...]:
    """The buckets a step of at most max_tokens tokens can choose from (all of them for None), and
    at least one past the small path's reach, so that a larger call (a decode graph captured past
    the budget) still finds the grouped path."""
    if max_tokens is None:
        return BUCKETS
    top = max(max_tokens, SMALL_MAX_TOKENS + 1)
    return BUCKETS[:min(bisect.bisect_left(BUCKETS, top), len(BUCKETS) - 1) + 1]


def measure(w13, w2, top_k: int, buckets: tuple[int, ...] = BUCKETS) -> dict:
    """{bucket: {"path", "tiles", "us": {...}}} for one expert shape on its GPU (module docstring)."""
    E, two_i, H = w13.shape
    gen = torch.Generator(device=w13.device).manual_seed(E * 31 + H)
    _raise_clocks(w13.device)
    table = {}
    # quantized experts: only tiles whose K widths fit the scale blocks or groups
    int4 = format_name(w13) == "-int4"
    small_gu = [c for c in SMALL_CANDIDATES + (INT4_SMALL_CANDIDATES if int4 else []) if tiles_fit(w13, c.block_k)]
    small_dn = [c for c in SMALL_CANDIDATES if tiles_fit(w2, small_down_block_k(c, top_k))]
    grouped = GROUPED_CANDIDATES + (INT4_GROUPED_CANDIDATES if int4 else [])
    for T in buckets:
        t0 = time.perf_counter()
        x = torch.randn(T, H, generator=gen, device=w13.device).to(w13.dtype)
        experts = torch.rand(T, E, generator=gen, device=w13.device).topk(top_k, dim=-1).indices.to(torch.int32)
        weights = torch.rand(T, top_k, generator=gen, device=w13.device)
        hidden = torch.randn(T * top_k, two_i // 2, generator=gen, device=w13.device).to(w13.dtype)
        timings: dict[str, dict] = {}
        if T <= SMALL_MAX_TOKENS:
            gu = _time_all({c: lambda c=c: fused_moe_small(x, w13, w2, weights, experts, (c, small_dn[0]))
                            for c in small_gu})
            best_gu = _best(gu)
            dn = _time_all({c: lambda c=c: fused_moe_small(x, w13, w2, weights, experts, (best_gu, c))
                            for c in small_dn})
            timings["small"] = dict(tiles=(best_gu, _best(dn)), us=dn[_best(dn)])
        for bm in sorted({c.block_m for c in grouped}):
            cands = [c for c in grouped if c.block_m == bm and tiles_fit(w13, c.block_k)]
            layout = align_by_expert(experts, E, bm)
            gu = _time_all({c: lambda c=c: grouped_gemm(x, w13, layout, T * top_k, top_k, c, gated=True)
                            for c in cands})
            dn = _time_all({c: lambda c=c: grouped_gemm(hidden, w2, layout, T * top_k, 1, c, route_weights=weights)
                            for c in cands})
            tiles = (_best(gu), _best(dn))
            for path in GROUPED_PATHS:         # the whole path as the layer runs it, as the small path is timed
                run = lambda fuse=path == "grouped": fused_moe_grouped(x, w13, w2, weights, experts, tiles,  # noqa: E731
                                                                       fuse_sum=fuse)
                best_us = min((t["us"] for t in timings.values()), default=float("inf"))
                timings[f"{path}{bm}"] = dict(path=path, tiles=tiles, us=_us(run, best_us))
        best = min(timings, key=lambda k: timings[k]["us"])
        table[str(T)] = {"path": timings[best].get("path", "small"), "tiles": [list(t) for t in timings[best]["tiles"]],
                         "us": {k: v["us"] for k, v in timings.items()}}
        log.info("MoE tiles (E=%d, H=%d, top-k %d, %s): %d tokens, %d paths timed in %.1f s: %s %s, %.1f us", E, H,
                 top_k, format_name(w13) or str(w13.dtype), T, len(timings), time.perf_counter() - t0,
                 table[str(T)]["path"], " / ".join(str(tuple(t)) for t in timings[best]["tiles"]), timings[best]["us"])
    return table


def moe_plan(w13, w2, top_k: int, max_tokens: int | None = None) -> MoePlan:
    """The plan for this expert shape (float weights or a quantized experts format: each format its own
    key) on its GPU, for steps of at most max_tokens tokens (the engine's max_num_batched_tokens; a
    bucket no step reaches is not timed): from the per-device cache, the buckets it lacks measured
    now and added to it."""
    E, two_i, H = w13.shape
    dtype = str(w13.dtype).removeprefix("torch.") + format_name(w13)
    path = table_file("moe", "moe", w13.device, f"e{E}k{top_k}h{H}i{two_i // 2}-{dtype}")
    table = measured(path, VERSION, buckets_for(max_tokens), lambda buckets: measure(w13, w2, top_k, buckets))
    return MoePlan({int(t): (e["path"], _tiles(e["path"], e["tiles"])) for t, e in table.items()},
                   {int(t): e["us"] for t, e in table.items()})
