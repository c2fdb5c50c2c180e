"""What a layer costs in one step, stated by the layer itself (`Module.cost(step)`) from the batch's
shape and its own weights' precision: FLOPs and the minimum bytes an ideal kernel moves. The
roofline only sums what the model's modules say, so a new layer type brings its cost with it.

Conventions (the ideal kernel's traffic, so that time / (bytes / bandwidth) says how far a kernel
is from the memory roof): every operand read once and every result written once, weights once a
step whatever the token count (why decode is memory-bound); [m, k] x [k, n] is 2*m*n*k FLOPs, a
bias m*n; attention 4 * head_dim FLOPs per (query head, query row, key) pair (Q.K, P.V), softmax
left out as in FlashAttention's accounting; integer index tensors left out. An op names the module
whose forward runs it (`module`, relative to the module that returned it); where several name one
module, the last is its own and the ones before run inside its forward (called from it or fused
into its kernel): a measured time of the module belongs to them together.

Tensor parallelism: a model built with a TensorParallel of size N states rank 0's share (its
slices of the weights, heads and KV), plus each collective its forward runs, as an op of kind
"collective" (emitted only when N > 1): the bytes one rank sends over its link (`link_bytes`) for
the message, counted as NCCL's ring does (nccl-tests' bus bandwidth is defined so that
link_bytes / busbw is the time): an all-reduce of M bytes sends 2(N-1)/N x M (reduce-scatter,
then all-gather), an all-gather of an output of M bytes (N-1)/N x M. Its FLOPs (the adds) and
HBM bytes are left out, as integer index tensors are: its time is the link's (latency per call
plus link_bytes / bus bandwidth), so MBU stays each GPU's weights, KV and activations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """Storage: bytes an element (scales included), and the matrix ceiling its products run on."""
    name: str
    bytes: float
    compute: str


DTYPE_PRECISIONS = {torch.float32: Precision("fp32", 4, "fp32"), torch.bfloat16: Precision("bf16", 2, "bf16"),
                    torch.float16: Precision("fp16", 2, "fp16"), torch.float8_e4m3fn: Precision("fp8", 1, "fp8")}


# an activation quantized for an FP8 GEMM: an e4m3 byte an element plus one fp32 scale per token
# and 128 channels (ridge/kernels/fp8_gemm.py)
FP8_ACT = Precision("fp8-act128", 1 + 4 / 128, "fp8")


def precision_of(dtype: torch.dtype) -> Precision:
    if dtype not in DTYPE_PRECISIONS:
        raise ValueError(f"dtype: no cost precision for {dtype}")
    return DTYPE_PRECISIONS[dtype]


@dataclass(frozen=True)
class StepShape:
    """One flat batch: per sequence its new tokens this step and its context length after it.
    `dtype` is the activations' (and by default the KV cache's); `kv_bytes` (KV bytes an element)
    and `weights` (the projections' storage) are what-ifs for formats the model is not loaded in."""
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_sampled: int | None = None       # rows that compute logits (default: one per sequence)
    greedy: bool = True
    dtype: torch.dtype = torch.bfloat16
    kv_bytes: float | None = None
    weights: Precision | None = None

    def __post_init__(self):
        if len(self.query_lens) != len(self.context_lens) or not self.query_lens:
            raise ValueError("step shape: query_lens and context_lens must be non-empty and of equal length")
        for q, c in zip(self.query_lens, self.context_lens):
            if not 1 <= q <= c:
                raise ValueError(f"step shape: need 1 <= query length <= context length, got {q} and {c}")

    num_tokens = property(lambda self: sum(self.query_lens))
    num_seqs = property(lambda self: len(self.query_lens))
    sampled_rows = property(lambda self: self.num_seqs if self.num_sampled is None else self.num_sampled)
    num_decode_seqs = property(lambda self: sum(1 for q in self.query_lens if q == 1))
    num_prefill_tokens = property(lambda self: sum(q for q in self.query_lens if q > 1))
    act = property(lambda self: precision_of(self.dtype))
    kv_elt = property(lambda self: self.act.bytes if self.kv_bytes is None else self.kv_bytes)


@dataclass(slots=True)
class OpCost:
    name: str
    kind: str                 # "gemm", "attention", "elementwise", "embedding", "sampling" or "collective"
    flops: float
    bytes: float              # minimum bytes moved, all operands
    param_bytes: float = 0.0  # of which parameters
    kv_bytes: float = 0.0     # of which KV-cache reads and writes
    calls: int = 1            # kernels' worth of calls in the step
    compute: str = "bf16"     # the matrix ceiling its FLOPs are held against
    module: str = ""          # the module whose forward runs it (see the module docstring)
    # a MoE layer's load in the step, when known: (most pairs on one expert, mean pairs an expert,
    # experts with none); summed ops keep the most imbalanced layer's
    expert_load: tuple[int, float, int] | None = None
    link_bytes: float = 0.0   # a collective's bytes one rank sends over its link (ring-counted)
    ranks: int = 1            # a collective's group size


def all_reduce_cost(name: str, rows: int, width: int, step: StepShape, ranks: int) -> list[OpCost]:
    """The sum over `ranks` ranks of a [rows, width] activation (one call); nothing for one rank."""
    if ranks < 2:
        return []
    message = rows * width * step.act.bytes
    return [OpCost(name, "collective", 0.0, 0.0, compute="link", link_bytes=2 * (ranks - 1) / ranks * message,
                   ranks=ranks)]


def all_gather_cost(name: str, rows: int, width: int, element_bytes: float, ranks: int) -> list[OpCost]:
    """The ranks' [rows, width] shares side by side into [rows, ranks * width] (one call); nothing
    for one rank."""
    if ranks < 2:
        return []
    output = rows * width * ranks * element_bytes
    return [OpCost(name, "collective", 0.0, 0.0, compute="link", link_bytes=(ranks - 1) / ranks * output,
                   ranks=ranks)]


def child(path: str, costs: list[OpCost], name: str | None = None) -> list[OpCost]:
    """A child module's costs as its parent states them (the list is the child's fresh one, so it
    is relabelled in place): module paths under `path`, optionally renamed."""
    for c in costs:
        c.module = f"{path}.{c.module}" if path and c.module else path or c.module
        c.name = name or c.name
    return costs


def gemm_cost(name: str, rows: int, weight: torch.Tensor | tuple[int, int], bias: torch.Tensor | None,
              w: Precision, step: StepShape, out_bytes: float | None = None, in_bytes: float | None = None) -> OpCost:
    """x [rows, k] @ weight[n, k]^T (+ bias), the weight (a tensor, or its (n, k) shape) stored as `w`;
    x's elements `in_bytes` each (default: the activation dtype's)."""
    (n, k), a = tuple(weight.shape if isinstance(weight, torch.Tensor) else weight), step.act.bytes
    params = n * k * w.bytes + (n * bias.element_size() if bias is not None else 0)
    flops = 2 * rows * n * k + (rows * n if bias is not None else 0)
    return OpCost(name, "gemm", flops, params + rows * k * (a if in_bytes is None else in_bytes)
                  + rows * n * (a if out_bytes is None else out_bytes), params, compute=w.compute)


def act_quant_cost(rows: int, k: int, step: StepShape) -> OpCost:
    """The separate pass that quantizes an FP8 GEMM's [rows, k] input (where no producer fused it):
    reads the activation, writes FP8_ACT; |x|, the running max, the divide and the clamp: 4 FLOPs
    an element."""
    n = rows * k
    return OpCost("act_quant", "elementwise", 4 * n, n * (step.act.bytes + FP8_ACT.bytes), compute=step.act.compute)
