"""Time the ops of a real engine step.

The model is instrumented from the outside, never edited: forward pre/post hooks on the modules
that are ops (found by their checkpoint-style names), and wrappers set on a few instances for
what is not a module (the attention backend's KV write, the LM head, host-side batch
preparation). Each op runs inside a named range; nesting is kept, and an op's time is its
*exclusive* time (inclusive minus its timed children), so the op times of a step never overlap.

  - CPU: ops are synchronous, so the host clock around a range is the op's time. One extra
    repetition under torch.profiler counts the torch calls (dispatches) each op makes.
  - CUDA: the ranges are torch.profiler `record_function` ranges; each kernel is attributed to
    the innermost range that launched it, and an op's time is the sum of its kernels' device
    durations. The whole step is timed without instrumentation, with CUDA events; the step time
    minus the kernels' busy time is launch/idle time (host work, launch gaps, synchronisation).

Steps are built through the engine itself: requests added to the real scheduler, which
allocates pages and page tables; `ModelRunner.execute` and `ModelRunner.sample` run them. A
decode step's context is made without running its prefill: the scheduler admits the prompts,
the sequences are advanced as the engine would after a prefill, and the KV pool holds random
values, so the decode step reads `context` real pages per sequence (timing does not depend on
the values).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.autograd.profiler import record_function

from ridge.roofline.cost_model import StepShape

OP_PREFIX = "ridge.op/"
REP_PREFIX = "ridge.rep/"
HOST = "host"          # host-side batch preparation (lists -> device tensors): not a roofline op
# Triton launches its kernels through the driver API (cuLaunchKernelEx), which the profiler does
# not correlate with the Python range that launched them: such kernels arrive as device events
# with no CPU parent. A Triton launch hook logs, for each launch, the kernel's name and the op
# range open on the host; on one stream the k-th device event of a kernel is its k-th launch,
# which ties each event to its op (one kernel may serve several ops, e.g. the GEMV).


# leaf module name -> op
MODULE_OPS = {
    "embed_tokens": "embed", "input_layernorm": "norm", "post_attention_layernorm": "norm", "norm": "final_norm",
    "qkv_proj": "qkv_proj", "q_norm": "qk_norm", "k_norm": "qk_norm", "attn": "attention",
    "o_proj": "o_proj", "gate_up_proj": "gate_up_proj", "down_proj": "down_proj",
    # SiLU-and-mul is down_proj's input_act; where the small-batch GEMV fuses it, it is never
    # called and its cost is folded into down_proj (diagnose)
    "input_act": "activation",
}


class Timeline:
    """Nested named ranges. Modes:
      "clock"   host clock; exclusive times accumulated per label (CPU ops are synchronous);
      "profile" torch.profiler record_function ranges (kernel times are read from the profile);
      "events"  CUDA events, the device drained before each range opens, so a range holds its own
                kernels plus one launch latency (the fallback where the profiler cannot attribute
                kernels); `collect()` turns them into exclusive times;
      "off"     nothing (an uninstrumented run)."""

    def __init__(self, mode: str = "clock"):
        if mode not in ("clock", "profile", "events", "off"):
            raise ValueError(f"timeline mode: {mode!r}")
        self.mode = mode
        self.reset()

    def reset(self) -> None:
        self.stack: list[list] = []
        self.times: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.closed: list[list] = []

    def push(self, label: str) -> None:
        if self.mode == "off":
            return
        self.calls[label] += 1
        if self.mode == "clock":
            self.stack.append([label, time.perf_counter(), 0.0])
        elif self.mode == "profile":
            rf = record_function(OP_PREFIX + label)
            rf.__enter__()
            self.stack.append([label, rf])
        else:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.stack.append([label, start, None, []])

    def pop(self, label: str) -> None:
        if self.mode == "off":
            return
        entry = self.stack.pop()
        if entry[0] != label:
            raise RuntimeError(f"timeline: range {label!r} closed while {entry[0]!r} was open")
        if self.mode == "clock":
            inclusive = time.perf_counter() - entry[1]
            self.times[label] += inclusive - entry[2]
            if self.stack:
                self.stack[-1][2] += inclusive
        elif self.mode == "profile":
            entry[1].__exit__(None, None, None)
        else:
            entry[2] = torch.cuda.Event(enable_timing=True)
            entry[2].record()
            (self.stack[-1][3] if self.stack else self.closed).append(entry)

    def collect(self) -> None:
        """"events" mode: exclusive seconds per label from the recorded events."""
        torch.cuda.synchronize()

        def visit(entry) -> float:
            inclusive = entry[1].elapsed_time(entry[2]) / 1e3
            self.times[entry[0]] += inclusive - sum(visit(child) for child in entry[3])
            return inclusive
        for entry in self.closed:
            visit(entry)
        self.closed = []

    @contextlib.contextmanager
    def range(self, label: str):
        self.push(label)
        try:
            yield
        finally:
            self.pop(label)

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self.push(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop(label)
        timed.__wrapped__ = fn
        return timed


@contextlib.contextmanager
def instrument_runner(runner, tl: Timeline):
    """Install the op ranges on a ModelRunner's model (hooks and instance wrappers); removed on exit."""
    model = runner.model
    handles, restore = [], []

    def set_attr(obj, name, value):
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        restore.append((obj, name, had, old))

    for name, module in model.named_modules():
        op = MODULE_OPS.get(name.rsplit(".", 1)[-1])
        if op is None:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, args, op=op: tl.push(op)))
        handles.append(module.register_forward_hook(lambda m, args, out, op=op: tl.pop(op)))
        backend = getattr(module, "backend", None)
        if op == "attention" and dataclasses.is_dataclass(backend) and hasattr(backend, "rope_write_kv"):
            set_attr(module, "backend", dataclasses.replace(
                backend, rope_write_kv=tl.wrap("rope_kv_write", backend.rope_write_kv)))
    set_attr(model, "compute_logits", tl.wrap("lm_head", model.compute_logits))
    for name in ("prepare", "decode_inputs", "sampling_batch"):
        if callable(getattr(runner, name, None)):
            set_attr(runner, name, tl.wrap(HOST, getattr(runner, name)))
    # A replayed CUDA graph runs no Python, so no op range would open: while instrumented, decode
    # steps take the runner's eager path, which launches the same kernels on the same buffers.
    graphs = getattr(getattr(runner, "decode_graphs", None), "graphs", None)
    if isinstance(graphs, dict) and graphs:
        set_attr(runner.decode_graphs, "graphs", {})
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for obj, name, had, old in reversed(restore):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


# -- timing a step ---------------------------------------------------------------------------------
@dataclass
class StepTiming:
    step_s: float                         # the step, uninstrumented (median)
    op_s: dict[str, float]                # label -> exclusive time per step (median over reps)
    calls: dict[str, float]               # label -> calls per step
    kernels: dict[str, float | None]      # label -> kernels (GPU) / torch calls (CPU) per step; None: unknown
    other_s: float = 0.0                  # GPU: kernels launched outside every op range
    graph: bool = False                   # the step replays a CUDA graph (its ops timed eagerly)
    step_reps_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def busy_s(self) -> float:
        return sum(self.op_s.values()) + self.other_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def triton_launch_log(tl: Timeline, launches: list[tuple[str, str]]):
    """While open, append (kernel name, innermost open op label or "") for every Triton launch."""
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    def hook(metadata) -> None:
        launches.append((metadata.data["name"], tl.stack[-1][0] if tl.stack else ""))

    chain = knobs.runtime.launch_enter_hook     # Triton 3.6: a HookChain (other hooks stay in it)
    chain.add(hook)
    try:
        yield
    finally:
        chain.remove(hook)


def _attribute(events, device_times: bool, prof=None, launches=()):
    """Per (rep, label): summed kernel durations (s) and kernel counts when `device_times`, else
    counts of top-level torch calls. Each kernel/call goes to the innermost op range around it."""
    times: dict[tuple[int, str], float] = defaultdict(float)
    counts: dict[tuple[int, str], int] = defaultdict(int)
    if device_times and prof is not None and launches:
        _attribute_uncorrelated(prof, times, counts, launches)
    for evt in events:
        if device_times:
            # GPU-side copies of our own ranges (kineto's gpu_user_annotation) are not kernels
            kernels = [k for k in evt.kernels if not k.name.startswith((OP_PREFIX, REP_PREFIX))]
            if not kernels:
                continue
        elif not evt.name.startswith("aten::"):
            continue
        label, rep, p = None, None, (evt if device_times else evt.cpu_parent)
        nested = False
        while p is not None:
            if p.name.startswith(OP_PREFIX):
                label = label or p.name[len(OP_PREFIX):]
            elif p.name.startswith(REP_PREFIX):
                rep = int(p.name[len(REP_PREFIX):])
                break
            elif not device_times and label is None and p.name.startswith("aten::"):
                nested = True                     # called by another torch op, not by Python
            p = p.cpu_parent
        if rep is None or nested:
            continue
        label = label or ""
        if device_times:
            times[rep, label] += sum(k.duration for k in kernels) / 1e6
            counts[rep, label] += len(kernels)
        else:
            counts[rep, label] += 1
    return times, counts


def _attribute_uncorrelated(prof, times, counts, launches: list[tuple[str, str]]) -> None:
    """Kernels the profiler could not tie to a CPU range (Triton's, see triton_launch_log) are
    dropped from prof.events(), but kineto's raw records keep them: match each kernel's device
    events, in start order, to its logged launches, in launch order, which name the op; the rep
    is the one running on the host when the kernel started (each rep ends with a device sync)."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:
        return
    events = list(raw.events())

    def start_ns(e):
        return e.start_ns() if hasattr(e, "start_ns") else e.start_us() * 1000

    def duration_ns(e):
        return e.duration_ns() if hasattr(e, "duration_ns") else e.duration_us() * 1000

    labels: dict[str, deque] = defaultdict(deque)
    for name, label in launches:
        labels[name].append(label)
    reps = sorted((start_ns(e), int(e.name()[len(REP_PREFIX):])) for e in events
                  if e.name().startswith(REP_PREFIX) and str(e.device_type()).endswith("CPU"))
    kernels = sorted((e for e in events if not str(e.device_type()).endswith("CPU") and labels.get(e.name())),
                     key=start_ns)
    for e in kernels:
        label = labels[e.name()].popleft()
        t = start_ns(e)
        rep = next((r for lo, r in reversed(reps) if lo <= t), None)
        if rep is None or not label:
            continue
        times[rep, label] += duration_ns(e) / 1e9
        counts[rep, label] += 1


def time_step(step_fn: Callable[[Timeline], None], device: torch.device | str, reps: int = 5, warmup: int = 2,
              install: Callable[[Timeline], contextlib.AbstractContextManager] | None = None) -> StepTiming:
    """Time one step, its ops and its launch/idle time.

    `step_fn(tl)` runs one step; it may open ranges itself (`with tl.range("op")`), and/or
    `install(tl)` instruments what it runs (as `instrument_runner` does)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    reps = max(1, reps)
    off = Timeline("off")
    for _ in range(warmup):
        step_fn(off)
    _sync(device)

    install = install or (lambda tl: contextlib.nullcontext())
    op_reps: dict[str, list[float]] = defaultdict(list)
    notes: list[str] = []
    other_s = 0.0
    step_reps = []
    if cuda:
        # 1. the step as it runs (no hooks, no profiler), on the device's clock
        for _ in range(reps):
            _sync(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step_fn(off)
            end.record()
            end.synchronize()
            step_reps.append(start.elapsed_time(end) / 1e3)
        # 2. each op's kernels, under the profiler (kernel durations do not depend on it)
        tl = Timeline("profile")
        launches: list[tuple[str, str]] = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            with install(tl), triton_launch_log(tl, launches):
                for r in range(reps):
                    with record_function(f"{REP_PREFIX}{r}"):
                        step_fn(tl)
                    _sync(device)
        times, counts = _attribute(prof.events(), device_times=True, prof=prof, launches=launches)
        labels = {label for _, label in times} | set(tl.calls)
        for label in labels:
            series = [times.get((r, label), 0.0) for r in range(reps)]
            if label:
                op_reps[label] = series
            else:
                other_s = statistics.median(series)
        kernels = {label: sum(counts.get((r, label), 0) for r in range(reps)) / reps for label in labels if label}
        calls = {label: n / reps for label, n in tl.calls.items()}
        missing = [label for label in calls if label != HOST and not kernels.get(label)]
        if missing:
            # Ranges that ran but got no kernels from the profiler (a launcher it cannot
            # correlate): time them with CUDA events instead, and say so.
            etl = Timeline("events")
            series = defaultdict(list)
            with install(etl):
                for _ in range(reps):
                    etl.reset()
                    step_fn(etl)
                    etl.collect()
                    for label in missing:
                        series[label].append(etl.times.get(label, 0.0))
            for label in missing:
                op_reps[label] = series[label]
                kernels[label] = None
            notes.append(f"no kernels attributed by the profiler to {', '.join(sorted(missing))}: timed with "
                         f"CUDA events around each call, the device drained first (includes one launch latency "
                         f"per call; no kernel count)")
    else:
        # The step alone and the step with its op ranges, alternately, so that both see the same
        # machine (a CPU shared with other work drifts between one block of runs and the next).
        tl = Timeline("clock")
        for _ in range(reps):
            t = time.perf_counter()
            step_fn(off)
            step_reps.append(time.perf_counter() - t)
            with install(tl):
                tl.reset()
                step_fn(tl)
            for label, t in tl.times.items():
                op_reps[label].append(t)
        calls = dict(tl.calls)
        # one more run under the profiler, to count the torch calls each op makes
        ptl = Timeline("profile")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with install(ptl):
                with record_function(f"{REP_PREFIX}0"):
                    step_fn(ptl)
        _, counts = _attribute(prof.events(), device_times=False)
        kernels = {label: n for (_, label), n in counts.items() if label}
    step_s = statistics.median(step_reps)
    op_s = {label: statistics.median(series + [0.0] * (reps - len(series))) for label, series in op_reps.items()}
    busy = sum(op_s.values()) + other_s
    if busy > step_s:
        # The step and its ops are timed in different repetitions (instrumentation perturbs the
        # step); when the step is busy end to end, medians of the two can cross by noise.
        notes.append(f"step time raised from {step_s * 1e3:.4g} ms to the ops' summed time "
                     f"{busy * 1e3:.4g} ms: the step is busy end to end and the two medians come "
                     f"from different repetitions")
        step_s = busy
    return StepTiming(step_s=step_s, op_s=op_s, calls=calls, kernels=kernels, other_s=other_s,
                      step_reps_s=step_reps, notes=notes)


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


def _shape(sched, precision, sampling) -> StepShape:
    return StepShape.from_scheduler_output(sched, precision, greedy=sampling == "greedy")


def build_prefill(engine, batch: int, prompt_len: int, precision, sampling: str = "greedy", seed: int = 0) -> BuiltStep:
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
                     _shape(sched, precision, sampling))


def build_decode(engine, batch: int, context: int, precision, sampling: str = "greedy", seed: int = 1) -> BuiltStep:
    """A decode step of `batch` sequences with `context` tokens each (the new one included)."""
    if context < 2:
        raise ValueError("context: a decode step needs at least 2 tokens of context")
    if engine.scheduler.has_work():
        raise ValueError("engine: roofline steps need an idle engine")
    ids = _add(engine, _prompts(engine.model_cfg.vocab_size, batch, context - 1, seed), sampling)
    sched = engine.scheduler.schedule()
    if len(sched.scheduled) != batch or any(i.num_new_tokens != context - 1 for i in sched.scheduled):
        release(engine, ids)
        raise ValueError(f"max_num_batched_tokens/max_num_seqs: the scheduler did not admit all {batch} "
                         f"prompts of {context - 1} tokens at once")
    # As if the prefill had run: its tokens are in the cache and one token was sampled.
    g = torch.Generator().manual_seed(seed + 7)
    for item in sched.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.token_ids.append(int(torch.randint(3, engine.model_cfg.vocab_size, (1,), generator=g)))
    sched = engine.scheduler.schedule()
    ok = len(sched.scheduled) == batch and all(
        i.num_new_tokens == 1 and i.start == context - 1 for i in sched.scheduled)
    if not ok or sched.preempted:
        release(engine, ids)
        raise ValueError(f"kv_cache_memory: could not schedule {batch} decodes at context {context}")
    return BuiltStep("decode", batch, context, 1, sched, [i.seq for i in sched.scheduled], ids,
                     _shape(sched, precision, sampling))


def release(engine, ids) -> None:
    for rid in ids.request_ids if isinstance(ids, BuiltStep) else ids:
        engine.abort(rid)


def fill_kv_pool(runner, seed: int = 0) -> None:
    """Random K/V in the whole pool, so a decode's synthetic context holds ordinary numbers."""
    g = torch.Generator(device=runner.kv_cache.device).manual_seed(seed)
    runner.kv_cache.uniform_(-1.0, 1.0, generator=g)


def engine_step_fn(engine, built: BuiltStep) -> Callable[[Timeline], None]:
    """One step as the engine runs it (forward of the flat batch, logits of the sampling rows,
    sampling), without the scheduler's and the output bookkeeping's host work."""
    runner, eos = engine.runner, engine.eos_ids

    def step(tl: Timeline) -> None:
        fwd = runner.execute(built.sched)
        with tl.range("sampling"):
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
    timing = time_step(engine_step_fn(engine, built), engine.cfg.device, reps, warmup,
                       install=lambda tl: instrument_runner(engine.runner, tl))
    if replays_graph(engine.runner, built.sched):
        timing.graph = True
        timing.notes.append("the step replays a CUDA graph: its time is the replay's; each op's kernels were "
                            "timed in an eager run of the same kernels")
    return timing
