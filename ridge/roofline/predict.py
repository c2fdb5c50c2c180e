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

Tensor parallelism (`tensor_parallel_size` N > 1): the step is rank 0's share (costs.RankShare:
its slices of the weights, heads and KV pages, in its own GPU's memory) plus the collectives its
forward runs, each at the link's roof: latency a call + link_bytes / bus bandwidth (the third
roof; `Ceilings.link(N)`: measured among N ranks where this machine has them, else the assumed
NVLink figures, which the caller should say). The collectives run in line, not overlapped with
compute (as ridge runs them), so their time adds to the step; `decode_comm_s` is that part.
"""
from __future__ import annotations

from dataclasses import dataclass

from ridge.config import DEFAULT_CPU_KV_BYTES, ModelConfig
from ridge.utils.ceilings import Ceilings
from ridge.layers.cost import OpCost, StepShape
from ridge.roofline.costs import (PRECISIONS, Format, RankShare, decode_shape, kv_bytes_per_token, parameter_bytes,
                                  prefill_shape, step_costs)

DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (1024, 4096, 16384)
DEFAULT_PRECISIONS = ("bf16", "fp8", "int4", "fp8-kv")
# share of GPU memory a server gives to weights + KV; the rest is activations, workspace, CUDA context
GPU_MEMORY_FRACTION = 0.9


def op_ideal_s(cost: OpCost, ceilings: Ceilings) -> float:
    """A compute op at the higher of its two roofs; a collective at the link's (latency a call
    plus its link bytes over the bus bandwidth)."""
    if cost.kind == "collective":
        return ceilings.link(cost.ranks).seconds(cost.link_bytes, cost.calls)
    return max(cost.flops / ceilings.peak(cost.compute), cost.bytes / ceilings.bandwidth)


def comm_s(costs: list[OpCost], ceilings: Ceilings) -> float:
    """The collectives' part of a step at the roofline (0 on one rank)."""
    return sum(op_ideal_s(c, ceilings) for c in costs if c.kind == "collective")


def launch_floor_s(ceilings: Ceilings) -> float:
    """The least a kernel of a step costs beyond its roofline time: the measured time per
    dependent trivial kernel in a replayed CUDA graph, else (not measured) per eager launch."""
    return ceilings.graph_launch or ceilings.launch_overhead


def launches_s(costs: list[OpCost], ceilings: Ceilings) -> float:
    """One launch floor per kernel, counting one kernel per op call (a collective's is inside the
    link's measured latency)."""
    return sum(c.calls for c in costs if c.kind != "collective") * launch_floor_s(ceilings)


def predicted_step_s(model, ceilings: Ceilings, shape: StepShape, with_launches: bool = False) -> float:
    """The roofline floor of one step (`model`: a module with cost(), a ModelConfig or a RankShare): each op at
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
        "communication": comm_s(costs, ceilings),
    }
    return max(terms, key=terms.get)


def default_kv_budget(cfg: ModelConfig | RankShare, ceilings: Ceilings, fmt: Format) -> float:
    """Bytes left for the KV cache: on a GPU, GPU_MEMORY_FRACTION of its memory minus the weights
    (a RankShare: one rank's share on its own GPU); on a CPU, the engine's default CPU pool."""
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
    tp: int = 1                   # tensor-parallel size: the times are a step of N ranks, each its share
    prefill_comm_s: float = 0.0   # of prefill_s, the collectives (at the link's roof)
    decode_comm_s: float = 0.0    # of decode_s, the collectives

    @property
    def decode_comm_share(self) -> float:
        return self.decode_comm_s / self.decode_s


def predict(cfg: ModelConfig, ceilings: Ceilings, batches=DEFAULT_BATCHES, contexts=DEFAULT_CONTEXTS,
            precisions=DEFAULT_PRECISIONS, kv_budget: float | None = None, page_size: int = 16,
            greedy: bool = True, tensor_parallel_size: int = 1) -> list[PredictionRow]:
    """A row per (precision, context, batch); at tensor_parallel_size N a step of N ranks (the
    module docstring), each rank's KV budget its own GPU's (kv_budget: bytes a rank)."""
    model = RankShare(cfg, tensor_parallel_size) if tensor_parallel_size != 1 else cfg
    rows = []
    for pname in precisions:
        if pname not in PRECISIONS:
            raise ValueError(f"precisions: unknown {pname!r}; expected one of {', '.join(PRECISIONS)}")
        f = PRECISIONS[pname]
        budget = default_kv_budget(model, ceilings, f) if kv_budget is None else kv_budget
        for ctx in contexts:
            pages = -(-ctx // page_size)
            per_seq = pages * page_size * kv_bytes_per_token(model, f.shape(StepShape((1,), (1,))))
            max_batch = int(budget // per_seq)
            for b in batches:
                pshape = f.shape(prefill_shape(b, ctx, greedy=greedy))
                pre = predicted_step_s(model, ceilings, pshape)
                dshape = f.shape(decode_shape(b, ctx, greedy=greedy))
                dec = predicted_step_s(model, ceilings, dshape)
                dec_launches = predicted_step_s(model, ceilings, dshape, with_launches=True)
                rows.append(PredictionRow(pname, b, ctx, pre, b * ctx / pre, dec, b / dec, dec_launches,
                                          decode_bound(model, ceilings, dshape), per_seq, max_batch, b <= max_batch,
                                          tensor_parallel_size, comm_s(step_costs(model, pshape), ceilings),
                                          comm_s(step_costs(model, dshape), ceilings)))
    return rows
