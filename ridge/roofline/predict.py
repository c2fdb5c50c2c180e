"""Napkin math from the measured ceilings and the cost model: what a step should take at the
roofline, for batch sizes, context lengths and precisions the user has not run.

Each op is assumed to run at its roof (max(FLOPs / peak, bytes / bandwidth)) and the ops run
back to back with no gaps: the floor a fused, graph-captured engine approaches. Beside it, the
same with one launch floor per kernel added (the cost model counts one kernel per op call): the
measured time per dependent trivial kernel inside a replayed CUDA graph. A batch-1 decode step
of an 8B model is ~300 dependent kernels, so that term is ~0.3 ms of a ~4 ms floor, and the
"prediction" of a real step is the floor plus it. The decode row names the term that dominates
the floor (weights, KV cache, compute or activations), and the KV budget gives the largest batch
whose pages fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from ridge.config import DEFAULT_CPU_KV_BYTES, ModelConfig
from ridge.utils.ceilings import Ceilings
from ridge.layers.cost import OpCost, StepShape
from ridge.roofline.costs import (PRECISIONS, Format, decode_shape, kv_bytes_per_token, parameter_bytes, prefill_shape,
                                  step_costs)

DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (1024, 4096, 16384)
DEFAULT_PRECISIONS = ("bf16", "fp8", "int4", "fp8-kv")
# share of GPU memory a server gives to weights + KV; the rest is activations, workspace, CUDA context
GPU_MEMORY_FRACTION = 0.9


def op_ideal_s(cost: OpCost, ceilings: Ceilings) -> float:
    return max(cost.flops / ceilings.peak(cost.compute), cost.bytes / ceilings.bandwidth)


def launch_floor_s(ceilings: Ceilings) -> float:
    """The least a kernel of a step costs beyond its roofline time: the measured time per
    dependent trivial kernel in a replayed CUDA graph, else (not measured) per eager launch."""
    return ceilings.graph_launch or ceilings.launch_overhead


def launches_s(costs: list[OpCost], ceilings: Ceilings) -> float:
    """One launch floor per kernel, counting one kernel per op call."""
    return sum(c.calls for c in costs) * launch_floor_s(ceilings)


def predicted_step_s(model, ceilings: Ceilings, shape: StepShape, with_launches: bool = False) -> float:
    """The roofline floor of one step (`model`: a module with cost() or a ModelConfig): each op at
    its roof, no gaps; with_launches adds one launch floor per kernel (launches_s)."""
    costs = step_costs(model, shape)
    return sum(op_ideal_s(c, ceilings) for c in costs) + (launches_s(costs, ceilings) if with_launches else 0.0)


def decode_bound(model, ceilings: Ceilings, shape: StepShape) -> str:
    costs = step_costs(model, shape)
    bw = ceilings.bandwidth
    terms = {
        "compute": sum(c.flops / ceilings.peak(c.compute) for c in costs),
        "weights": sum(c.param_bytes for c in costs) / bw,
        "KV cache": sum(c.kv_bytes for c in costs) / bw,
        "activations": sum(c.bytes - c.param_bytes - c.kv_bytes for c in costs) / bw,
    }
    return max(terms, key=terms.get)


def default_kv_budget(cfg: ModelConfig, ceilings: Ceilings, fmt: Format) -> float:
    """Bytes left for the KV cache: on a GPU, GPU_MEMORY_FRACTION of its memory minus the weights;
    on a CPU, the engine's default CPU pool."""
    if ceilings.device == "cuda" and ceilings.details.get("memory_bytes"):
        return max(0.0, GPU_MEMORY_FRACTION * ceilings.details["memory_bytes"]
                   - parameter_bytes(cfg, fmt.shape(StepShape((1,), (1,)))))
    return float(DEFAULT_CPU_KV_BYTES)


@dataclass
class PredictionRow:
    precision: str
    batch: int
    context: int
    prefill_s: float              # prefill of `batch` prompts of `context` tokens, one step
    prefill_tok_s: float
    decode_s: float               # one decode step of `batch` sequences at `context` (the floor)
    decode_tok_s: float
    decode_launches_s: float      # decode_s plus one launch floor per kernel
    decode_bound: str             # the term that dominates the decode step
    kv_bytes_per_seq: float
    max_batch: int                # sequences of `context` tokens that fit the KV budget
    fits: bool


def predict(cfg: ModelConfig, ceilings: Ceilings, batches=DEFAULT_BATCHES, contexts=DEFAULT_CONTEXTS,
            precisions=DEFAULT_PRECISIONS, kv_budget: float | None = None, page_size: int = 16,
            greedy: bool = True) -> list[PredictionRow]:
    rows = []
    for pname in precisions:
        if pname not in PRECISIONS:
            raise ValueError(f"precisions: unknown {pname!r}; expected one of {', '.join(PRECISIONS)}")
        f = PRECISIONS[pname]
        budget = default_kv_budget(cfg, ceilings, f) if kv_budget is None else kv_budget
        for ctx in contexts:
            pages = -(-ctx // page_size)
            per_seq = pages * page_size * kv_bytes_per_token(cfg, f.shape(StepShape((1,), (1,))))
            max_batch = int(budget // per_seq)
            for b in batches:
                pre = predicted_step_s(cfg, ceilings, f.shape(prefill_shape(b, ctx, greedy=greedy)))
                dshape = f.shape(decode_shape(b, ctx, greedy=greedy))
                dec = predicted_step_s(cfg, ceilings, dshape)
                dec_launches = predicted_step_s(cfg, ceilings, dshape, with_launches=True)
                rows.append(PredictionRow(pname, b, ctx, pre, b * ctx / pre, dec, b / dec, dec_launches,
                                          decode_bound(cfg, ceilings, dshape), per_seq, max_batch, b <= max_batch))
    return rows
