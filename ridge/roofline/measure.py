"""Time the ops of a real engine step (ridge/roofline/timeline.py does the timing).

The model is instrumented from the outside, never edited: forward pre/post hooks on the modules
that the model's own `cost(step)` names, each range labelled with the op the module states for
itself (ridge/layers/cost.py). Ops that run inside another module's forward (RoPE + KV write in
attention, SiLU-and-mul in down_proj) have no range of their own; the diagnosis charges them to
that module's op. Host-side batch preparation is the time from the step's start to the model's
forward (a pre-hook on the model closes it); the model's own ops (the LM head over the sampling
rows) run from the end of its forward to the end of `ModelRunner.execute`; sampling is timed
around `ModelRunner.sample`.

Steps are built through the engine itself: requests added to the real scheduler, which
allocates pages and page tables; `ModelRunner.execute` and `ModelRunner.sample` run them. A
decode step's context is made without running its prefill: the scheduler admits the prompts,
the sequences are advanced as the engine would after a prefill, and the KV pool holds random
values, so the decode step reads `context` real pages per sequence (timing does not depend on
the values).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ridge.layers.cost import OpCost, StepShape
from ridge.roofline.costs import op_costs, step_shape
from ridge.roofline.timeline import HOST, StepTiming, Timeline, time_step


def op_labels(costs: list[OpCost]) -> dict[str, str]:
    """module path -> the op its range is labelled with: the last op naming the module (its own).
    A collective is timed inside its module's range (a row-parallel projection's all-reduce with
    its GEMM), never as the module's own op."""
    return {c.module: c.name for c in costs if c.kind != "collective"}


@contextlib.contextmanager
def instrument_runner(runner, tl: Timeline, costs: list[OpCost]):
    """Forward hooks on the runner's model for the ops in `costs` (`model.cost(step)`); removed on exit."""
    model = runner.model
    labels = op_labels(costs)
    handles = []

    def close_host(m, args):
        if tl.stack and tl.stack[-1][0] == HOST:
            tl.pop(HOST)

    def open_own(m, args, out):
        if not tl.stack and "" in labels:
            tl.push(labels[""])

    for path, module in model.named_modules():
        if path == "":
            handles += [module.register_forward_pre_hook(close_host), module.register_forward_hook(open_own)]
        elif path in labels:
            op = labels[path]
            handles.append(module.register_forward_pre_hook(lambda m, args, op=op: tl.push(op)))
            handles.append(module.register_forward_hook(lambda m, args, out, op=op: tl.pop(op)))
    # A replayed CUDA graph runs no Python, so no op range would open: while instrumented, decode
    # steps take the runner's eager path, which launches the same kernels on the same buffers.
    graphs = getattr(runner, "decode_graphs", None)
    saved = graphs.graphs if graphs is not None else None
    if saved:
        graphs.graphs = {}
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if saved:
            graphs.graphs = saved


# -- real engine steps -----------------------------------------------------------------------------
@dataclass
class BuiltStep:
    name: str                 # "prefill" or "decode"
    batch: int
    context: int              # tokens of context per sequence after the step
    query_len: int            # new tokens per sequence
    sched: object             # SchedulerOutput
    seqs: list                # the sequences that sample
    request_ids: list[str]
    shape: StepShape


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = 3 if vocab > 3 else 0                # ids 0-2 are usually special tokens
    return [torch.randint(low, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _params(sampling: str):
    from ridge.engine.sampling_params import SamplingParams
    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=1, ignore_eos=True, seed=0)


def _add(engine, prompts, sampling) -> list[str]:
    ids = []
    try:
        for p in prompts:
            ids.append(engine.add_request(p, _params(sampling)))
    except ValueError:
        for rid in ids:
            engine.abort(rid)
        raise
    return ids


def _shape(engine, sched, sampling) -> StepShape:
    return step_shape(sched, engine.cfg.dtype, greedy=sampling == "greedy", kv_bytes=engine.runner.kv_element_bytes())


def build_prefill(engine, batch: int, prompt_len: int, sampling: str = "greedy", seed: int = 0) -> BuiltStep:
    """A step that prefills `batch` prompts of `prompt_len` tokens, scheduled by the engine."""
    if engine.scheduler.has_work():
        raise ValueError("engine: roofline steps need an idle engine")
    ids = _add(engine, _prompts(engine.model_cfg.vocab_size, batch, prompt_len, seed), sampling)
    sched = engine.scheduler.schedule()
    if len(sched.scheduled) != batch or any(i.num_new_tokens != prompt_len for i in sched.scheduled):
        release(engine, ids)
        raise ValueError(f"max_num_batched_tokens/max_num_seqs: the scheduler did not put all {batch} prompts "
                         f"of {prompt_len} tokens in one step")
    return BuiltStep("prefill", batch, prompt_len, prompt_len, sched, [i.seq for i in sched.scheduled], ids,
                     _shape(engine, sched, sampling))


def build_decode(engine, batch: int, context: int, sampling: str = "greedy", seed: int = 1) -> BuiltStep:
    """A decode step of `batch` sequences with `context` tokens each (the new one included)."""
    if context < 2:
        raise ValueError("context: a decode step needs at least 2 tokens of context")
    if engine.scheduler.has_work():
        raise ValueError("engine: roofline steps need an idle engine")
    ids = _add(engine, _prompts(engine.model_cfg.vocab_size, batch, context - 1, seed), sampling)
    # As if the prefills had run, chunk by chunk under max_num_batched_tokens (a decode step's
    # batch need not fit one prefill step): their tokens are in the cache, one token was sampled.
    g, filled = torch.Generator().manual_seed(seed + 7), set()
    while len(filled) < batch:
        sched = engine.scheduler.schedule()
        chunks = [i for i in sched.scheduled if id(i.seq) not in filled]
        if sched.preempted or not chunks:
            release(engine, ids)
            raise ValueError(f"max_num_seqs/kv_cache_memory: the scheduler did not admit all {batch} "
                             f"prompts of {context - 1} tokens")
        for item in chunks:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.num_computed_tokens == context - 1:
                item.seq.token_ids.append(int(torch.randint(3, engine.model_cfg.vocab_size, (1,), generator=g)))
                filled.add(id(item.seq))
    sched = engine.scheduler.schedule()
    ok = len(sched.scheduled) == batch and all(
        i.num_new_tokens == 1 and i.start == context - 1 for i in sched.scheduled)
    if not ok or sched.preempted:
        release(engine, ids)
        raise ValueError(f"kv_cache_memory: could not schedule {batch} decodes at context {context}")
    return BuiltStep("decode", batch, context, 1, sched, [i.seq for i in sched.scheduled], ids,
                     _shape(engine, sched, sampling))


def release(engine, ids) -> None:
    for rid in ids.request_ids if isinstance(ids, BuiltStep) else ids:
        engine.abort(rid)


def fill_kv_pool(runner, seed: int = 0) -> None:
    """Random K/V in the whole pool, so a decode's synthetic context holds ordinary numbers."""
    g = torch.Generator(device=runner.kv_cache.device).manual_seed(seed)
    if runner.kv_scales is None:
        runner.kv_cache.uniform_(-1.0, 1.0, generator=g)
        return
    runner.kv_scales.fill_(127 - 7)                  # an FP8 pool: rows of e4m3 in [-128, 128) x 2^-7
    for layer in runner.kv_cache:                    # one layer at a time: no pool-sized float copy
        layer.copy_(torch.empty(layer.shape, device=layer.device).uniform_(-128.0, 128.0, generator=g))


def engine_step_fn(engine, built: BuiltStep) -> Callable[[Timeline], None]:
    """One step as the engine runs it (forward of the flat batch, logits of the sampling rows,
    sampling), without the scheduler's and the output bookkeeping's host work. Under
    instrument_runner: host preparation, the model's ops, the model's own op, sampling."""
    runner, eos = engine.runner, engine.eos_ids
    sampling = next(c.name for c in op_costs(runner.model, built.shape) if c.kind == "sampling")

    def step(tl: Timeline) -> None:
        tl.push(HOST)
        fwd = runner.execute(built.sched)
        if tl.stack:                       # HOST, or the model's own op opened after its forward
            tl.pop(tl.stack[-1][0])
        with tl.range(sampling):
            runner.sample(fwd.logits, built.seqs, eos)
    return step


def replays_graph(runner, sched) -> bool:
    """Whether the runner serves this step by replaying a captured CUDA graph."""
    g = getattr(runner, "decode_graphs", None)
    if g is None or not getattr(g, "graphs", None) or not hasattr(runner, "decode_inputs"):
        return False
    try:
        d = runner.decode_inputs(sched)
        return d is not None and g.bucket_for(len(d.input_ids)) in g.graphs
    except (AttributeError, TypeError):
        return False


def time_engine_step(engine, built: BuiltStep, reps: int = 5, warmup: int = 2) -> StepTiming:
    costs = op_costs(engine.runner.model, built.shape)
    timing = time_step(engine_step_fn(engine, built), engine.cfg.device, reps, warmup,
                       install=lambda tl: instrument_runner(engine.runner, tl, costs))
    if replays_graph(engine.runner, built.sched):
        timing.graph = True
        timing.notes.append("the step replays a CUDA graph: its time is the replay's; each op's kernels were "
                            "timed in an eager run of the same kernels")
    return timing