"""Which FP8 GEMM serves a projection at a batch size: measured once per GPU, then looked up.

Block-scaled FP8 wins only where a GEMM is compute-bound, and by how much depends on the shape:
at decode sizes the activation-quantization pass and the scale loads can cost more than the
halved weight bytes save (block-FP8 is slower than bf16 at small M in vLLM, PR #23280), and which
kernel is fastest at prefill sizes (ridge's Triton kernel at one of a few tile configs, or
cuBLAS's block-scaled torch._scaled_mm) differs per GPU. So for each (N, K) the engine loads it
times, at one representative batch size per bucket (BUCKETS), every candidate on the same random
operands, the activation quantization included in the FP8 ones, replayed from a CUDA graph:
  * "triton:<config>": ridge's fp8_gemm at each of TRITON_CONFIGS (pointer-load tiles, split K,
    the persistent TMA kernel),
  * "cublas": cublas_fp8_gemm,
  * "bf16": the layer's bf16 path on the dequantized weight (ridge's GEMV up to its row limit, else
    cuBLAS via F.linear),
and keeps the fastest per bucket. A batch of M rows takes the choice of the first bucket >= M.
The FP8 times include the quantization pass, except for the projections whose producer quantizes
for them (QKV, gate-up, down: ridge/layers/quant/fp8/linear.py), which are timed on an activation
already quantized, the GEMM alone, as they run (their tables are cached apart: `fed`).
The table is cached per device (ridge/layers/tuning.py: RIDGE_CACHE_DIR/fp8), so only the first start
on a GPU pays for the timing (seconds for an 8B model).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ridge.kernels.fp8_gemm import cublas_fp8_gemm, fp8_gemm, quantize_act_fp8
from ridge.kernels.gemv import gemv
from ridge.layers.linear import uses_gemv
from ridge.layers.tuning import BUCKETS, Path, bucket_of, measured, table_file, time_paths
from ridge.utils.graph_timing import graph_time_us

TRITON_CONFIGS = {  # name -> fp8_gemm tile arguments; the ones benchmarks/fp8_gemm.py found fastest somewhere
    "tma128x128": dict(tma=True, block_m=128, block_n=128, num_warps=8, num_stages=3),
    "tma64x128": dict(tma=True, block_m=64, block_n=128, num_warps=4, num_stages=4),
    "tma64x64": dict(tma=True, block_m=64, block_n=64, num_warps=4, num_stages=5),
    "ptr64x128": dict(block_m=64, block_n=128, num_warps=4, num_stages=4),
    "ptr128x64": dict(block_m=128, block_n=64, num_warps=4, num_stages=4),
    "ptr64x64k4": dict(block_m=64, block_n=64, num_warps=4, num_stages=5, split_k=4),
    "ptr64x128k4": dict(block_m=64, block_n=128, num_warps=4, num_stages=4, split_k=4),
}
SPLIT_MAX_M = 512          # split K pays only while the tiles alone cannot fill the GPU
VERSION = 2                # 2: graph-replay timing


def fp8_matmul(path: str, x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ the block-scaled weight by an FP8 path: quantize x, then the GEMM."""
    return quantized_matmul(path, *quantize_act_fp8(x), wq, ws, x.dtype)


def quantized_matmul(path: str, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of an FP8 path on an activation already quantized (quantize_act_fp8's layout)."""
    if path == "cublas":
        return cublas_fp8_gemm(xq, xs, wq, ws, out_dtype)
    return fp8_gemm(xq, xs, wq, ws, out_dtype, **TRITON_CONFIGS[path.removeprefix("triton:")])


def bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float Linear's path: ridge's GEMV where Linear.forward takes it, else cuBLAS."""
    return gemv(x, w) if uses_gemv(x, w) else F.linear(x, w)


def measure_shape(w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, fed: bool = False,
                  buckets: tuple[int, ...] = BUCKETS) -> dict:
    """{bucket: {"choice": path, "us": {path: microseconds}, "errors": {...}}} for one weight (bf16 w
    and its FP8 form); fed: the FP8 paths' input arrives quantized (the GEMM alone is timed). Any
    error a path raises (a path this torch / GPU lacks, a config out of resources) rules it out."""
    n, k = w.shape
    gen = torch.Generator(device=w.device).manual_seed(n * 7 + k)
    table = {}
    for m in buckets:
        x = torch.randn(m, k, generator=gen, device=w.device).to(w.dtype)
        xq, xs = quantize_act_fp8(x) if fed else (None, None)
        paths = {"bf16": Path(lambda: bf16_matmul(x, w), catch=(Exception,))}
        for p in ["cublas"] + [f"triton:{c}" for c, a in TRITON_CONFIGS.items()
                               if a.get("split_k", 1) == 1 or m <= SPLIT_MAX_M]:
            run = ((lambda p=p: quantized_matmul(p, xq, xs, wq, ws, x.dtype)) if fed
                   else (lambda p=p: fp8_matmul(p, x, wq, ws)))
            paths[p] = Path(run, catch=(Exception,))
        table[str(m)] = time_paths(paths, timer=graph_time_us)
    return table


def dispatch_table(w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, fed: bool = False,
                   allow_bf16: bool = True) -> dict[int, str]:
    """{bucket: path} for this weight's (N, K) on its GPU (fed: its producer quantizes its input), from
    the per-device cache or measured now. allow_bf16=False: the fastest FP8 path of each bucket, for
    a model that cannot keep a bf16 copy of its weights beside the FP8 ones."""
    n, k = w.shape
    table = measured(table_file("fp8", "dispatch", w.device, f"{n}x{k}{'-fed' if fed else ''}"), VERSION, BUCKETS,
                     lambda buckets: measure_shape(w, wq, ws, fed, buckets))
    if allow_bf16:
        return {int(m): e["choice"] for m, e in table.items()}
    fp8 = {int(m): {p: t for p, t in e["us"].items() if p != "bf16"} for m, e in table.items()}
    missing = [m for m, us in fp8.items() if not us]
    if missing:
        raise RuntimeError(f"FP8 dispatch: no FP8 GEMM ran for {n}x{k} at batch {missing[0]} "
                           f"({table[str(missing[0])]['errors']}), and the bf16 weight cannot be kept")
    return {m: min(us, key=us.get) for m, us in fp8.items()}
