"""Which path serves an INT4 projection at a batch size: measured once per GPU and shape, then looked up.

Two paths compute x @ W from ridge's INT4 tables:
  * "int4": the INT4 kernels (ridge/kernels/int4_matmul.py): the skinny GEMV up to 32 rows, the
    wgmma GEMM past it, each dequantizing its weight tiles on the way to the tensor cores;
  * "dequant": the weight written out in 16 bits (ridge/kernels/int4_dequant.py), then cuBLAS.
The second moves ~4.5 bytes a weight against 0.5 and runs the tensor cores near their roof where
the INT4 GEMM reaches about half: a fixed cost that only a batch of enough rows repays, and where
that batch starts depends on the GPU and the shape. So the engine times both at each bucket of
fp8_dispatch.BUCKETS from 64 rows on (below, the 16-bit weight alone costs more than the whole
INT4 GEMM), on the same random activations, replayed from CUDA graphs, and keeps the faster; a
batch takes its bucket's choice (fp8_dispatch.bucket_of), and never "dequant" below 64 rows or while
a CUDA graph is being captured (a decode graph keeps no weight-sized scratch). The table is cached
per device (RIDGE_CACHE_DIR/int4), so only the first start on a GPU pays for the timing.
"""
from __future__ import annotations

import os

import torch

from ridge.kernels.int4_dequant import int4_dequantize
from ridge.kernels.int4_matmul import PACK, int4_matmul
from ridge.layers.quant.fp8_dispatch import BUCKETS as ALL_BUCKETS
from ridge.layers.quant.fp8_dispatch import bucket_of
from ridge.utils.device_cache import cache_root, cached, device_key
from ridge.utils.graph_timing import graph_time_us

MIN_ROWS = 64
BUCKETS = tuple(b for b in ALL_BUCKETS if b >= MIN_ROWS)
VERSION = 1


def dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """x [M, K] @ W by the "dequant" path: W in x's dtype (a transient [K, N]), then cuBLAS."""
    return x @ int4_dequantize(qweight, scales, zeros, group_size)


def measure_shape(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict:
    """{bucket: {"choice": path, "us": {path: microseconds}}} for one layer's tables."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    gen = torch.Generator(device=qweight.device).manual_seed(n * 7 + k)
    table = {}
    for m in BUCKETS:
        x = torch.randn(m, k, generator=gen, device=qweight.device).to(scales.dtype)
        us = {"int4": graph_time_us(lambda: int4_matmul(x, qweight, scales, zeros, group_size))}
        us["dequant"] = graph_time_us(lambda: dequant_matmul(x, qweight, scales, zeros, group_size),
                                      bound_us=us["int4"])
        table[str(m)] = {"choice": min(us, key=us.get), "us": us}
        del x
    return table


def dispatch_table(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int) -> dict[int, str]:
    """{bucket: path} for this layer's shape on its GPU, from the per-device cache or measured now."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    dtype = str(scales.dtype).removeprefix("torch.")
    name = f"dispatch-{device_key(qweight.device)}-{n}x{k}-g{group_size}-{dtype}.json"
    table = cached(os.path.join(cache_root(), "int4", name), VERSION,
                   lambda: measure_shape(qweight, scales, zeros, group_size))
    return {int(m): e["choice"] for m, e in table.items()}


def path_for(paths: dict[int, str] | None, m: int) -> str:
    """The path for a batch of m rows ("int4" with no table, below MIN_ROWS, or under graph capture)."""
    if paths is None or m < MIN_ROWS or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return "int4"
    return paths.get(bucket_of(m), "int4")
