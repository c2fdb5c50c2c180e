"""Which path serves an INT4 projection at a batch size: measured once per GPU and shape, then looked up.

Two paths compute x @ W from ridge's INT4 tables:
  * "int4": the INT4 kernels (ridge/kernels/int4_matmul.py): the skinny GEMV up to 32 rows, the
    wgmma GEMM past it, each dequantizing its weight tiles on the way to the tensor cores;
  * "dequant": the weight written out in 16 bits (ridge/kernels/int4_dequant.py), then cuBLAS.
The second moves ~4.5 bytes a weight against 0.5 and runs the tensor cores near their roof where
the INT4 GEMM reaches about half: a fixed cost that only a batch of enough rows repays, and where
that batch starts depends on the GPU and the shape. So the engine times both at each bucket of
ridge/layers/tuning.py's BUCKETS from 64 to 4,096 rows (below, the 16-bit weight alone costs more than the
whole INT4 GEMM; above, the last bucket's choice holds), on the same random activations, replayed
from CUDA graphs as decode and verify steps run, and keeps the faster (a path that fails, e.g. out
of memory, is recorded and not chosen). A batch takes its bucket's choice, eagerly and in a CUDA
graph alike. The 16-bit weight goes to one DequantWorkspace a device, allocated while the model loads
(so the KV pool, sized from what loading leaves, leaves room for it) and written by every layer in
turn: a transient weight per call would have to fit in whatever the KV pool left over.
The table is cached per device, torch and Triton version (ridge/layers/tuning.py: RIDGE_CACHE_DIR/int4), so only the
first start on a GPU pays for the timing; the timing's buffers go back to the device after it.
"""
from __future__ import annotations

import weakref

import torch
import triton

from ridge.kernels.int4_dequant import int4_dequantize
from ridge.kernels.int4_matmul import PACK, int4_matmul
from ridge.layers.tuning import BUCKETS as ALL_BUCKETS
from ridge.layers.tuning import Path, bucket_of, measured, table_file, time_paths
from ridge.utils.graph_timing import graph_time_us

MIN_ROWS, MAX_ROWS = 64, 4096
BUCKETS = tuple(b for b in ALL_BUCKETS if MIN_ROWS <= b <= MAX_ROWS)
VERSION = 1                # bump when int4_gemm or int4_dequant change what they cost


def dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W by the "dequant" path: W in x's dtype (into `weight` [K, N], or a new tensor), then cuBLAS."""
    return x @ int4_dequantize(qweight, scales, zeros, group_size, weight)


class DequantWorkspace:
    """The dequant path's 16-bit weight: one buffer a device and dtype, as large as the largest layer
    that takes the path, shared by all of them (their GEMMs run one after another on one stream). The
    layers hold it; it lives as long as one of them does. It grows only while models load: a CUDA graph
    that captured the buffer would write into freed memory after a growth, so that is an error."""
    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.captured = False

    @classmethod
    def shared(cls, device: torch.device, dtype: torch.dtype, numel: int) -> DequantWorkspace:
        """The workspace of (device, dtype), holding at least numel weights."""
        key = (str(device), dtype)
        ws = cls._live.get(key)
        if ws is None:
            ws = cls._live[key] = cls()
        ws.reserve(numel, device, dtype)
        return ws

    def reserve(self, numel: int, device: torch.device, dtype: torch.dtype) -> None:
        if self.buffer is not None and self.buffer.numel() >= numel:
            return
        if self.captured:
            raise RuntimeError(f"INT4 dequant workspace: a layer of {numel} weights loaded after a CUDA graph "
                               f"captured the {self.buffer.numel()}-weight buffer; load every model first")
        self.buffer = None                                      # the smaller one goes back first
        self.buffer = torch.empty(numel, dtype=dtype, device=device)

    def weight(self, k: int, n: int) -> torch.Tensor:
        """The buffer as a [k, n] weight."""
        self.captured |= self.buffer.is_cuda and torch.cuda.is_current_stream_capturing()
        return self.buffer[:k * n].view(k, n)


def measure_shape(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  buckets: tuple[int, ...] = BUCKETS) -> dict:
    """{bucket: {"choice": path, "us": {path: microseconds}, "errors": {...}}} for one layer's tables:
    the dequant path is timed against the INT4 time (it cannot win by more than its bound), and only
    its running out of memory (the 16-bit weight beside the model) rules it out; an INT4 kernel
    that fails is the engine's error."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    gen = torch.Generator(device=qweight.device).manual_seed(n * 7 + k)
    table = {}
    for m in buckets:
        x = torch.randn(m, k, generator=gen, device=qweight.device).to(scales.dtype)
        table[str(m)] = time_paths({
            "int4": Path(lambda: int4_matmul(x, qweight, scales, zeros, group_size)),
            "dequant": Path(lambda: dequant_matmul(x, qweight, scales, zeros, group_size),
                            catch=(torch.OutOfMemoryError, RuntimeError), bound="int4")}, timer=graph_time_us)
        del x
    if qweight.is_cuda:
        torch.cuda.empty_cache()        # the timing's buffers and graph pools, back before the KV pool is sized
    return table


def dispatch_table(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int) -> dict[int, str]:
    """{bucket: path} for this layer's shape on its GPU, from the per-device cache or measured now."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    dtype = str(scales.dtype).removeprefix("torch.")
    shape = f"triton{triton.__version__}-{n}x{k}-g{group_size}-{dtype}"
    table = measured(table_file("int4", "dispatch", qweight.device, shape), VERSION, BUCKETS,
                     lambda buckets: measure_shape(qweight, scales, zeros, group_size, buckets))
    return {int(m): e["choice"] for m, e in table.items()}


def path_for(paths: dict[int, str] | None, m: int) -> str:
    """The path for a batch of m rows ("int4" with no table or below MIN_ROWS)."""
    if paths is None or m < MIN_ROWS:
        return "int4"
    return paths.get(min(bucket_of(m), MAX_ROWS), "int4")
