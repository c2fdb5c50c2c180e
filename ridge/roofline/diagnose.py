"""Where each op sits on the roofline, what bounds it, and which lever moves it.

For an op with F FLOPs and B bytes that took t seconds, against measured ceilings (peak P FLOP/s
for its dtype, bandwidth W bytes/s):
    roofline time   t* = max(F / P, B / W)          (the op at the attainable roof)
    fraction        t* / t                           (= achieved / attainable throughput)
    binding roof    compute if F / P > B / W, else memory
and the label, checked in this order:
    memory- or compute-   fraction >= BOUND_FRACTION: the roof that binds at its intensity
      bound               (an op that reaches its roof is bound by it, however short it is)
    launch-bound          t / kernels < LAUNCH_BOUND_FACTOR x launch overhead: its kernels are
                          so short that launching them costs as much as running them
    implementation-bound  otherwise: far below both ceilings with kernels long enough, so
                          neither fewer bytes nor faster math is the first lever; the kernel is.
The launch overhead is the eager one, or the in-graph one for a step that replays a CUDA graph.
Elementwise ops are held against the matrix roof of their dtype too; their intensity (< 2
FLOP/byte) sits far left of any ridge point, so the memory roof is the one that binds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ridge.utils.ceilings import Ceilings
from ridge.layers.cost import OpCost, StepShape
from ridge.roofline.costs import imbalance, utilization
from ridge.roofline.predict import launch_floor_s, launches_s

# A kernel must last at least two launch overheads for the launching side to stay ahead of the
# device: between launches the host also runs the engine's Python (module calls, views), so at
# 1x the device already waits on every launch.
LAUNCH_BOUND_FACTOR = 2.0
# At half of the attainable roof or better, the roof is what binds: halving the bytes (or the
# FLOP cost) halves the time. Below it, most of the time is lost inside the kernel.
BOUND_FRACTION = 0.5
# Above this fraction of the memory roof, an op's bytes cannot all come from DRAM (allowing 10%
# for timing noise): its working set sits in cache, common on CPUs with a large L3.
CACHE_FRACTION = 1.1
# A MoE layer whose busiest expert has this many times the mean pairs or more gets a load note
# (the grouped GEMM's time follows its busiest expert, the weight bytes its distinct experts).
IMBALANCE_NOTE = 1.5
MIN_TILE_ROWS = 16
# A step whose device idles this share of the time or more gets "launch gaps" advice.
IDLE_ADVICE_FRACTION = 0.2

LABELS = ("memory-bound", "compute-bound", "launch-bound", "implementation-bound")


@dataclass
class OpRow:
    op: str
    kind: str                            # OpCost.kind
    time_s: float | None                 # None: not measured on its own
    share: float                         # of the step time
    calls: float
    kernels: float | None                # GPU kernels / CPU torch calls per step
    flops: float
    bytes: float
    intensity: float | None              # FLOP/byte (None: no FLOPs)
    achieved_flops: float                # FLOP/s
    achieved_bandwidth: float            # bytes/s
    compute_roof: str                    # the matrix ceiling its FLOPs are held against
    peak_flops: float
    attainable_flops: float              # min(peak, intensity x bandwidth)
    roof: str                            # "memory" or "compute": which binds at its intensity
    ideal_s: float                       # time at the roof
    fraction: float | None               # ideal_s / time_s
    label: str
    advice: str = ""

    @property
    def lost_s(self) -> float:
        return 0.0 if self.time_s is None else max(0.0, self.time_s - self.ideal_s)


@dataclass
class StepReport:
    name: str                            # "prefill" or "decode"
    title: str
    batch: int
    context: int
    query_len: int
    tokens: int
    step_time_s: float
    ops_time_s: float                    # summed op rows
    host_time_s: float                   # host batch preparation (GPU: its copies)
    other_time_s: float                  # GPU kernels outside every op range
    idle_time_s: float                   # step - the above: launch gaps, host work, syncs
    idle_fraction: float
    flops: float
    bytes: float
    weight_bytes: float
    kv_bytes: float
    mfu: float
    mbu: float
    predicted_s: float                   # the sum of the ops' roofline times
    predicted_launches_s: float          # predicted_s + one launch floor per kernel (predict.launches_s)
    label: str
    rows: list[OpRow]
    advice: list[str] = field(default_factory=list)
    first_target: str = ""
    notes: list[str] = field(default_factory=list)
    step_reps_s: list[float] = field(default_factory=list)
    cuda_graph: bool = False             # the step replays a CUDA graph


def _ideal(flops: float, nbytes: float, peak: float, bandwidth: float) -> tuple[float, str]:
    t_compute, t_memory = flops / peak, nbytes / bandwidth
    return (t_compute, "compute") if t_compute > t_memory else (t_memory, "memory")


def launch_overhead(ceilings: Ceilings, graph: bool = False) -> float:
    """The per-kernel launch cost that applies: inside a replayed CUDA graph, the graph's."""
    return ceilings.graph_launch if graph and ceilings.graph_launch else ceilings.launch_overhead


def classify(flops: float, nbytes: float, time_s: float, kernels: float | None, ceilings: Ceilings,
             compute: str = "bf16", graph: bool = False) -> tuple[str, float, str]:
    """(label, fraction of the roofline, binding roof) of one measured op."""
    ideal, roof = _ideal(flops, nbytes, ceilings.peak(compute), ceilings.bandwidth)
    fraction = ideal / time_s if time_s > 0 else float("inf")
    if fraction >= BOUND_FRACTION:
        return f"{roof}-bound", fraction, roof
    if kernels and time_s / kernels < LAUNCH_BOUND_FACTOR * launch_overhead(ceilings, graph):
        return "launch-bound", fraction, roof
    return "implementation-bound", fraction, roof


def op_row(cost: OpCost, time_s: float | None, kernels: float | None, calls: float, step_time_s: float,
           ceilings: Ceilings, graph: bool = False) -> OpRow:
    peak, bw = ceilings.peak(cost.compute), ceilings.bandwidth
    ideal, roof = _ideal(cost.flops, cost.bytes, peak, bw)
    ai = cost.flops / cost.bytes if cost.flops and cost.bytes else None
    attainable = min(peak, ai * bw) if ai else 0.0
    if time_s is None or time_s <= 0:
        return OpRow(cost.name, cost.kind, None, 0.0, calls, kernels, cost.flops, cost.bytes, ai, 0.0, 0.0,
                     ceilings.roof(cost.compute), peak, attainable, roof, ideal, None, "not measured")
    label, fraction, _ = classify(cost.flops, cost.bytes, time_s, kernels, ceilings, cost.compute, graph)
    return OpRow(cost.name, cost.kind, time_s, time_s / step_time_s if step_time_s else 0.0, calls, kernels, cost.flops,
                 cost.bytes, ai, cost.flops / time_s, cost.bytes / time_s, ceilings.roof(cost.compute), peak,
                 attainable, roof, ideal, fraction, label)


# -- advice ----------------------------------------------------------------------------------------
def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt_rate(v: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if v >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


def op_advice(row: OpRow, ceilings: Ceilings, step: str, graph: bool = False) -> str:
    cuda = ceilings.device == "cuda"
    if row.label == "launch-bound":
        per = row.time_s / row.kernels if row.kernels else row.time_s
        what = "kernels" if cuda else "torch calls"
        if cuda and graph:
            lever = "already in a CUDA graph: fuse the op's kernels into fewer, longer ones"
        elif cuda and ceilings.graph_launch:
            lever = (f"capture the step in a CUDA graph (measured {_fmt_time(ceilings.graph_launch)} a kernel "
                     f"there) and fuse the op's kernels")
        else:
            lever = "CUDA graphs and fusion on a GPU; here, fewer and larger torch calls (fuse, batch more tokens)"
        return (f"{row.kernels:.0f} {what} of {_fmt_time(per)} each, under {LAUNCH_BOUND_FACTOR:g}x the "
                f"{'in-graph ' if graph else ''}launch overhead ({_fmt_time(launch_overhead(ceilings, graph))}): "
                f"{lever}")
    if row.label == "memory-bound":
        if row.kind == "gemm":
            tip = ("INT4 or FP8 weights cut the weight bytes 4x or 2x; a larger batch reuses each weight "
                   f"byte over more tokens (intensity {row.intensity:.3g} FLOP/byte now)")
        elif row.kind == "attention":
            tip = ("it streams the KV cache: an FP8 KV cache halves the bytes; a larger batch does not help "
                   "(each sequence reads its own context)")
        elif row.kind == "sampling":
            tip = "one fused pass over the logits (penalties, softmax, top-k/p and the draw together)"
        else:
            tip = ("fuse it into a neighbour so its input never round-trips through memory (residual+RMSNorm, "
                   "SiLU-and-mul in gate_up's epilogue), or use 8-bit activations")
        where = (f"above the measured memory roof ({row.fraction:.0%}): its operands come from on-chip cache "
                 "(the working set fits), so that is the roof it meets" if row.fraction > CACHE_FRACTION else
                 f"at {row.fraction:.0%} of bandwidth, only fewer bytes help")
        return f"{where}: {tip}"
    if row.label == "compute-bound":
        roof = row.compute_roof
        fp8 = ceilings.matmul.get("fp8")
        if fp8 and roof in ("bf16", "fp16", "tf32", "fp32") and fp8 > ceilings.matmul[roof]:
            return (f"at {row.fraction:.0%} of the {roof} matrix roof: FP8 tensor cores "
                    f"(measured {_fmt_rate(fp8, 'FLOP/s')}, {fp8 / ceilings.matmul[roof]:.2g}x) are the lever")
        faster = [(k, v) for k, v in ceilings.matmul.items() if v > ceilings.matmul[roof] * 1.2]
        if faster:
            k, v = max(faster, key=lambda kv: kv[1])
            return (f"at {row.fraction:.0%} of the {roof} matrix roof: {k} math is measured at "
                    f"{v / ceilings.matmul[roof]:.2g}x ({_fmt_rate(v, 'FLOP/s')})")
        return (f"at {row.fraction:.0%} of the {roof} matrix roof: the FLOPs themselves must shrink "
                "(lower precision tensor cores, less recompute, e.g. prefix caching)")
    if row.label == "implementation-bound":
        hint = ("small-M GEMM: split-K or a GEMV-style kernel" if row.kind == "gemm" and step == "decode"
                else "tiling, vectorised loads, occupancy")
        return (f"at {row.fraction:.0%} of its {row.roof} roof (intensity {row.intensity or 0:.3g} FLOP/byte): "
                f"the kernel itself is the lever ({hint})")
    return ""


# -- a step ----------------------------------------------------------------------------------------
def diagnose_step(name: str, shape: StepShape, costs: list[OpCost], timing, ceilings: Ceilings,
                  batch: int, context: int, query_len: int) -> StepReport:
    """Rows, step summary, label and advice of one measured step (`timing`: measure.StepTiming)."""
    op_s, kernels, calls = dict(timing.op_s), dict(timing.kernels), dict(timing.calls)
    notes = list(timing.notes)
    costs = list(costs)
    # An op with no time of its own ran inside the forward of a module that hosts a timed op too
    # (called from it, or fused into its kernel: RoPE + KV write in attention, SiLU-and-mul in
    # down_proj's GEMV): its cost is charged to the timed ops of that module, split evenly.
    for inner in [c for c in costs if not op_s.get(c.name)]:
        hosts = [c.name for c in costs if c.module == inner.module and c is not inner and op_s.get(c.name)]
        if not hosts:
            continue
        share = 1.0 / len(hosts)
        costs = [c if c.name not in hosts else dataclasses.replace(
            c, flops=c.flops + share * inner.flops, bytes=c.bytes + share * inner.bytes,
            param_bytes=c.param_bytes + share * inner.param_bytes, kv_bytes=c.kv_bytes + share * inner.kv_bytes)
            for c in costs if c is not inner]
        op_s.pop(inner.name, None)
        notes.append(f"{inner.name} is not timed on its own: it runs inside {' and '.join(hosts)} "
                     f"({inner.module or 'the model'}), whose time includes it; its cost is included there")
    for c in costs:
        # below a tile's worth of rows an expert (MIN_TILE_ROWS) every expert's rows fit one tile:
        # the layer is bound by its weight bytes, not by how the rows spread
        if imbalance(c) >= IMBALANCE_NOTE and c.expert_load[1] >= MIN_TILE_ROWS:
            most, mean, idle = c.expert_load
            notes.append(f"{c.name}: expert load is uneven: up to {most} (token, expert) pairs on one expert against a "
                         f"mean of {mean:.3g} ({imbalance(c):.1f}x; {idle} experts got none) in the most imbalanced "
                         f"layer; tiles of the busiest expert run after the others finish")
    step = timing.step_s
    graph = getattr(timing, "graph", False)
    rows = [op_row(c, op_s.get(c.name), kernels.get(c.name), calls.get(c.name, 0.0), step, ceilings, graph)
            for c in costs]
    ops_time = sum(r.time_s for r in rows if r.time_s is not None)
    host = op_s.get("host", 0.0)
    other = timing.other_s
    idle = max(0.0, step - ops_time - host - other)
    flops = sum(c.flops for c in costs)
    nbytes = sum(c.bytes for c in costs)
    mfu, mbu = utilization(costs, step, ceilings)
    predicted = sum(r.ideal_s for r in rows)
    for r in rows:
        r.advice = op_advice(r, ceilings, name, graph)

    buckets = {label: sum(r.time_s for r in rows if r.label == label) for label in LABELS}
    buckets["launch-bound"] += idle + host
    label = max(buckets, key=buckets.get)

    advice = []
    idle_share = idle / step if step else 0.0
    if idle_share >= IDLE_ADVICE_FRACTION:
        where = ("the GPU waits between kernels (launch gaps, host work): "
                 + ("" if graph else "CUDA graphs for decode steps, ")
                 + "fewer kernels (fusion), less host work and no host syncs inside the step"
                 if ceilings.device == "cuda" else
                 "the CPU runs Python between torch calls: fewer, larger ops (fusion); on a GPU this "
                 "becomes launch gaps, which CUDA graphs remove")
        advice.append(f"{idle_share:.0%} of the step ({_fmt_time(idle)}) is outside every op: {where}")
    candidates = [(r.lost_s, r) for r in rows if r.time_s is not None]
    lost_idle = idle + host
    best = max(candidates, key=lambda x: x[0], default=(0.0, None))
    if best[1] is not None and best[0] >= lost_idle:
        r = best[1]
        first = (f"attack {r.op} first: {_fmt_time(r.time_s)} against {_fmt_time(r.ideal_s)} at its roofline "
                 f"({r.label}; {r.advice})")
    else:
        first = (f"attack launch/idle time first: {_fmt_time(lost_idle)} of the step runs no op "
                 f"(host preparation {_fmt_time(host)}, gaps {_fmt_time(idle)})")
    if name == "decode" and buckets["memory-bound"] >= 0.3 * step and batch < 32:
        advice.append(f"decode at batch {batch} streams every weight per step for {batch} token(s): "
                      "larger batches raise tokens/s almost for free until the GEMMs turn compute-bound")
    with_launches = predicted + launches_s(costs, ceilings)
    advice.append(f"judge {name} by {'MBU' if name == 'decode' else 'MFU'}: "
                  f"MBU {mbu:.1%}, MFU {mfu:.1%}; the roofline floor of this step is {_fmt_time(predicted)} "
                  f"({predicted / step:.0%} of the measured {_fmt_time(step)}), "
                  f"{_fmt_time(with_launches)} with {sum(c.calls for c in costs)} kernels at the measured "
                  f"{_fmt_time(launch_floor_s(ceilings))} launch floor each ({with_launches / step:.0%})")
    title = (f"{name} batch {batch}, context {context}" if name == "decode" else
             f"{name} batch {batch} x {query_len} tokens")
    return StepReport(name=name, title=title, batch=batch, context=context, query_len=query_len,
                      tokens=shape.num_tokens, step_time_s=step, ops_time_s=ops_time, host_time_s=host,
                      other_time_s=other, idle_time_s=idle, idle_fraction=idle_share, flops=flops, bytes=nbytes,
                      weight_bytes=sum(c.param_bytes for c in costs), kv_bytes=sum(c.kv_bytes for c in costs),
                      mfu=mfu, mbu=mbu, predicted_s=predicted,
                      predicted_launches_s=with_launches, label=label, rows=rows, advice=advice,
                      first_target=first, notes=notes, step_reps_s=list(timing.step_reps_s), cuda_graph=graph)
